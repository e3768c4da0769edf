"""How long the README's `tpsim triage` story takes (issue 35: under a minute on 2 cores): the DeepSeek-V3
draft with edited ids, SGLang 0.5.12 at TP 8, replayed on a stand-in of all 61 layers, every fix replayed.
Each run a fresh process (median of --repeats); the same command with and without `+embed`.

    .venv/bin/python benchmarks/triage.py [--repeats 3] [--out benchmarks/results/triage-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def story() -> list[str]:
    from test_triage import readme_triage
    return readme_triage()


def run(argv: list[str]) -> tuple[float, dict]:
    tpsim = str(Path(sys.executable).with_name("tpsim"))
    t0 = time.perf_counter()
    r = subprocess.run([tpsim, *argv, "--json"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{shlex.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-300:]}")
    return took, json.loads(r.stdout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/triage-cpu.json"))
    args = p.parse_args(argv)
    from tpsim.base import ui
    from tpsim.base.atomic import write_json

    base = story()
    server = base.index("--server") + 1
    patched = base[:server] + [base[server] + "+embed"] + base[server + 1:]
    rows, out = [], {}
    for name, cmd in (("as in the README", base), ("with --server ...+embed", patched)):
        runs, rep = [], {}
        for _ in range(args.repeats):
            took, rep = run(cmd)
            runs.append(took)
        med = statistics.median(runs)
        replayed = sum(f["fix_replayed"] for f in rep["findings"])
        out[name] = {"argv": cmd, "median_s": med, "runs_s": runs, "findings": len(rep["findings"]),
                     "fixes_replayed": replayed}
        rows.append([name, f"{med:.1f} s", " ".join(f"{x:.1f}" for x in runs), str(len(rep["findings"])),
                     str(replayed)])
    ui.table(["tpsim triage (fresh process, 2-core target)", "median", "runs", "findings", "fixes replayed"], rows)
    print("target: under 60 s on 2 cores")
    write_json(Path(args.out), {"benchmark": "triage-story", "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "load_average_at_end": os.getloadavg(), "repeats": args.repeats, "target_s": 60, "commands": out})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
