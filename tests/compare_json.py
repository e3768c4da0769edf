#!/usr/bin/env python3
"""Run the README's examples with --json in two checkouts and compare their output byte for byte:
the proof that a re-layout changed no answer.

    python tests/compare_json.py BASE_REV        # a clean worktree of BASE_REV vs this checkout
    python tests/compare_json.py --dir OTHER     # another checkout vs this one

Each command runs as `python -m tpsim` with PYTHONPATH set to the checkout and its cwd inside it
(the examples name configs by relative path); the checkout's own path and scenario --all's
"seconds" are masked. Exit 0 when every output is identical, 1 otherwise."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

# name -> argv; {tmp} is one scratch directory per checkout (the capture files diagnose reads)
COMMANDS = {
    "check": ["check", "--json"],
    "check-ar-fusion": ["check", "--mode", "ar-fusion", "--strategy", "model-level", "--tp", "1,2", "--json"],
    "explain-v3": ["explain", "--model", "deepseek-v3", "--tp", "2", "--json"],
    "triage-0.5.12": ["triage", "--draft-config", "configs/drafts/ids-at-top-level.json",
                      "--server", "sglang@0.5.12:deepseek_v3", "--tp", "8", "--json"],
    "triage-0.5.14": ["triage", "--draft-config", "configs/drafts/ids-at-top-level.json",
                      "--server", "sglang@0.5.14:deepseek_v3", "--tp", "2", "--json"],
    "align": ["align", "--draft-config", "configs/drafts/deepseek-v3-top-level-copy.json",
              "--server", "vllm:deepseek_v3", "--num-layers", "61", "--json"],
    "align-specforge": ["align", "--train", "specforge-ids:1,29,57", "--serve", "sglang-ids:-1,2,30",
                        "--num-layers", "61", "--json"],
    "capture-run": ["capture", "--tp", "2", "--points", "embed.out,layers.3.attn.o_proj.partial,layers.3.out",
                    "--seq-len", "8", "--out", "{tmp}/run.safetensors", "--force"],
    "capture-ref": ["capture", "--tp", "1", "--points", "embed.out,layers.3.attn.o_proj.partial,layers.3.out",
                    "--seq-len", "8", "--out", "{tmp}/ref.safetensors", "--force"],
    "diagnose": ["diagnose", "{tmp}/run.rank0.safetensors", "{tmp}/run.rank1.safetensors",
                 "--reference", "{tmp}/ref.rank0.safetensors", "--json"],
    "resolve": ["resolve", "--convention", "specforge-ids", "--layers", "1,29,57", "--num-layers", "61", "--json"],
    "scenario-all": ["scenario", "--all", "--json"],
}


SECONDS = re.compile(r'("seconds": )[0-9.e+-]+')  # scenario --all's wall time per scenario: the only clock in the output


def outputs(checkout: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "NO_COLOR": "1"}
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in COMMANDS.items():
            argv = [a.replace("{tmp}", tmp) for a in argv]
            r = subprocess.run([sys.executable, "-m", "tpsim", *argv], cwd=checkout, env=env,
                               capture_output=True, text=True, timeout=600)
            out = r.stdout.replace(tmp, "{tmp}").replace(str(checkout), "{checkout}")
            got[name] = f"exit {r.returncode}\n" + SECONDS.sub(r"\1...", out)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", nargs="?", help="a git revision of this repository")
    ap.add_argument("--dir", type=Path, help="another checkout")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as wt:
        if args.dir is None:
            subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", wt, args.rev or "HEAD"],
                           check=True, capture_output=True)
        base_dir = args.dir or Path(wt)
        try:
            base, now = outputs(base_dir), outputs(HERE)
        finally:
            if args.dir is None:
                subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", wt], check=False)
    differ = 0
    for name in COMMANDS:
        same = base[name] == now[name]
        differ += not same
        print(f"{'identical' if same else 'DIFFERENT'}  {name}  ({len(now[name])} bytes)")
        if not same:
            sys.stdout.writelines(difflib.unified_diff(base[name].splitlines(True), now[name].splitlines(True),
                                                       "base", "now", n=1))
    print(f"{len(COMMANDS) - differ} of {len(COMMANDS)} outputs identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
