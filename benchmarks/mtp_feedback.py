"""The cost of an MTP feed-back mismatch in AL (issue 53 deliver 2): the committed MTP-style head for SmolLM2-135M
(benchmarks/train_smollm2_mtp.py: trained on the target's final post-norm hidden) fed as trained, fed the pre-norm
block output out(29) at step 0, and fed its own post-norm output between steps, over the built-in held-out prompts
(configs/prompts/smollm2-135m.json), with tpsim's exact offline acceptance (tpsim.app.mtp_acceptance).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mtp_feedback.py    # ~30 s on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=ROOT / "configs" / "drafts" / "smollm2-135m-mtp")
    ap.add_argument("--prompts", type=Path, default=ROOT / "configs" / "prompts" / "smollm2-135m.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mtp-feedback-cpu.json")
    args = ap.parse_args()
    from tpsim.app.mtp_acceptance import measure
    from tpsim.bench.environment import git_commit
    t0 = time.time()
    m = measure(args.head, args.prompts, args.steps)
    out = {"command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mtp_feedback.py", "model": "smollm2-135m",
           "head": str(args.head.relative_to(ROOT)), "prompts": str(args.prompts.relative_to(ROOT)), "k": args.steps,
           "trained_on": "step 0: final (post-norm); steps 1+: the head's own pre-norm output",
           **m.to_dict(), "seconds": round(time.time() - t0, 1), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "python": platform.python_version(), "commit": git_commit()}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
