"""Run an installed vLLM (its own interpreter: `--engine-python`, e.g. .venv-engine/bin/python from `make engine`)
on a target checkpoint and an EAGLE-3 draft, and read back what it observed: per rank the prefill's aux hidden
states, the generated tokens, the spec-decode counters, the version and model runner, or the start-up refusal's
own text. Several launches share one interpreter (vLLM's imports are paid once)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tpsim.base.errors import UsageError

HERE = Path(__file__).resolve().parent
MARK = "tpsim-engine: launch"  # vllm_main.MARK
ENV = {"VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of KV cache per CPU rank
       "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # 'auto' refuses more ranks than NUMA nodes
       "OMP_NUM_THREADS": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # LLM.apply_model sends a function
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
WORKER_ERROR = re.compile(r"Worker failed with error '(.+)'")
NOT_A_CAUSE = ("Engine core initialization failed",)
# where vLLM's error texts go on to list what it has (every registered architecture, every parameter): cut there
LISTINGS = (" Supported architectures:", " The available parameters belonging to")
# a pydantic ValidationError from vLLM's config classes names the ValueError its validator raised
VALIDATION = re.compile(r"Value error, (.+)$", re.M)
FIND_VLLM = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d))\n"
             "        break\n    except m.PackageNotFoundError:\n        pass\nelse:\n    raise SystemExit(1)")
LOG_FACTS = ("Using auxiliary layers from speculative config", "Model Runner V2", "model runner v2",
             "Detected EAGLE model", "Sharing target model embedding")


@dataclass(frozen=True)
class Launch:
    """One vLLM launch: the target checkpoint and draft directories, TP, k, the prompts (token ids) and how many
    tokens to generate after each. No draft (`draft` None): the target alone, `aux_ids` set on its own capture loop
    (`set_aux_hidden_state_layers`) and the aux states it returns taken off before its runner sees them.
    `custom_ops`: vLLM's compilation_config.custom_ops (e.g. "-rotary_embedding": that op's native PyTorch path)."""

    target: Path
    draft: Path | None
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    tp: int = 1
    k: int = 3
    method: str = "eagle3"  # speculative_config's method
    dtype: str = "float32"
    prefix_caching: bool = False
    attention_backend: str | None = None
    max_model_len: int = 2048
    aux_ids: tuple[int, ...] | None = None
    custom_ops: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = asdict(self)
        return {**d, "target": os.path.abspath(self.target), "draft": self.draft and os.path.abspath(self.draft),
                "prompts": [list(p) for p in self.prompts], "max_tokens": list(self.max_tokens),
                "aux_ids": self.aux_ids and list(self.aux_ids), "custom_ops": list(self.custom_ops)}


@dataclass(frozen=True)
class Counts:
    """vLLM's spec-decode counters (`LLM.get_metrics()`), read as its own golden test reads them."""

    drafts: int
    accepted: int
    per_position: tuple[int, ...]

    @property
    def length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(a / self.drafts if self.drafts else 0.0 for a in self.per_position)


@dataclass(frozen=True)
class Observed:
    """What one launch did. `refused`: the start-up error's own text (its root cause in the log) when it did not
    start; then nothing else is there."""

    version: str
    refused: str | None = None
    failed: str | None = None  # it started, then failed while serving: the error's own text (root cause)
    runner: str | None = None  # "v1" / "v2"
    capture_ids: tuple[int, ...] | None = None  # the ids the target's capture loop holds (rank 0)
    aux: tuple[tuple[torch.Tensor, ...], ...] = field(default=(), repr=False)  # [rank][sequence]: [n, T, H]
    generated: tuple[tuple[int, ...], ...] = ()
    counts: Counts | None = None
    log: tuple[str, ...] = ()  # the lines of vLLM's log that say what it chose (LOG_FACTS)
    load_s: float = 0.0
    generate_s: float = 0.0


def engine_version(python: str) -> tuple[str, str]:
    """The vLLM distribution `python` has (vllm-cpu, vLLM's CPU build, or vllm) and its version (UsageError, one
    line, when it has none)."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        raise UsageError(f"--engine-python {python}: no such interpreter; `make engine` builds one "
                         "(.venv-engine/bin/python, vLLM's CPU build)")
    try:
        got = subprocess.run([python, "-c", FIND_VLLM], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"--engine-python {python}: it does not run ({e}); give a Python with vLLM installed") from None
    if got.returncode != 0:
        raise UsageError(f"--engine-python {python}: no vLLM installed there; `make engine` builds .venv-engine with "
                         "vLLM's CPU build, or give the Python of your engine's venv")
    dist, _, version = got.stdout.strip().partition(" ")
    return dist, version


def run(python: str, launches: list[Launch], timeout_s: float) -> list[Observed]:
    """Every launch, one after another, in one engine interpreter."""
    with tempfile.TemporaryDirectory(prefix="tpsim-engine-") as tmp:
        out = Path(tmp)
        (out / "request.json").write_text(json.dumps({"launches": [x.to_json() for x in launches]}))
        env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        with open(out / "log.txt", "w") as log:
            proc = subprocess.Popen([os.path.abspath(python), str(HERE / "vllm_main.py"), str(out / "request.json"), str(out)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise UsageError(f"the engine did not finish {len(launches)} launches in {timeout_s:.0f} s; "
                                 "raise --timeout (vLLM's CPU build takes ~20 s a launch and ~55 tokens/s)") from None
        segments = (out / "log.txt").read_text(errors="replace").split(MARK)[1:]
        if code != 0 or len(segments) < len(launches):
            tail = (out / "log.txt").read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"the engine's interpreter exited {code} after {len(segments)} of {len(launches)} "
                               f"launches: {tail[0]}")
        return [_read(out / str(n), segments[n]) for n in range(len(launches))]


def _read(folder: Path, log: str) -> Observed:
    result = json.loads((folder / "result.json").read_text())
    lines = log.splitlines()
    facts = tuple(dict.fromkeys(line.split("] ", 1)[-1].strip() for line in lines
                                if any(f in line for f in LOG_FACTS)))
    if result["refused"] is not None:
        return Observed(result["vllm"], refused=gist(root_cause(lines) or result["refused"]), log=facts)
    aux = []
    for rank in range(len(result["capture_ids"])):
        aux.append(tuple(torch.from_numpy(np.load(folder / f"aux.rank{rank}.seq{s}.npy"))
                         for s in range(len(result["sequences"])) if (folder / f"aux.rank{rank}.seq{s}.npy").exists()))
    c = result["counters"]
    counts = Counts(int(c.get("vllm:spec_decode_num_drafts", 0)), int(c.get("vllm:spec_decode_num_accepted_tokens", 0)),
                    tuple(int(x) for x in c.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])))
    ids = result["capture_ids"][0]
    failed = result.get("failed") and _worker_error(lines, result["failed"])
    return Observed(result["vllm"], None, failed, result["runner"], None if ids is None else tuple(ids), tuple(aux),
                    tuple(tuple(s["generated"]) for s in result["sequences"]), counts, facts,
                    result["load_s"], result["generate_s"])


def _worker_error(lines: list[str], raised: str) -> str:
    """A failure while serving in the worker's own words (the engine core reports it as EngineDeadError)."""
    found = (m.group(1) for line in lines if (m := WORKER_ERROR.search(line)))
    return next(found, raised)


def gist(text: str) -> str:
    """An error's own words without the listing vLLM appends; a config ValidationError as its validator's ValueError."""
    m = text.startswith("ValidationError") and VALIDATION.search(text)
    text = f"ValueError: {m.group(1)}" if m else text
    for cut in LISTINGS:
        text = text.split(cut)[0]
    return text.strip()


def root_cause(lines: list[str]) -> str | None:
    """The first error a worker or the engine core raised (vLLM's own words), not the wrapper that reports it."""
    for line in lines:
        m = ERROR.search(line)
        if m and not any(w in m.group(2) for w in NOT_A_CAUSE):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None
