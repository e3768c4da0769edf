"""The seed's story, measured (issue 36 item 6): the acceptance length a wrong capture costs on a real target,
SmolLM2-135M-Instruct with the draft tpsim trained for it (`smollm2-135m-eagle3`, SpecForge's recipe on
`specforge-ids:1,14,26` = out(1), out(14), out(26)), its 12 held-out prompts, k = 3. Each case is the draft's
config as a user would serve it (ids edited, at another key) and the engine's flags; every case runs
`tpsim acceptance --json` in a fresh process, so the wall time is the command's.

    .venv/bin/python benchmarks/acceptance.py [--out benchmarks/results/acceptance-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
DRAFT = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    argv: tuple[str, ...]
    edit: dict = field(default_factory=dict)  # config.json keys replaced (None: removed)


TRAIN = ("--train", "specforge-ids:1,14,26")
CASES = [
    Case("as trained", "the config as trained, SGLang 0.5.12, TP 1", ("--server", "sglang@0.5.12")),
    Case("TP 3", "the same at TP 3, plain TP (the capture all-reduced: the whole stream)",
         ("--server", "sglang@0.5.12", "--tp", "3")),
    Case("embedding slot", "ids edited to [-1, 14, 26]: slot 0 takes the embedding output, which training never "
                           "captured (SGLang 0.5.12 patched so that -1 runs: +embed)",
         ("--server", "sglang@0.5.12+embed"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 14, 26]}}),
    Case("off by one", "ids edited to [2, 15, 27] (\"SGLang numbers from the input\"): every slot one layer late",
         ("--server", "sglang@0.5.12"), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}),
    Case("key fallback", "ids moved to a key SGLang does not read (top-level target_layer_ids): its default "
                         "[2, 15, 27] in its numbering, which captures what the trained ids do",
         ("--server", "sglang@0.5.12"), {"eagle_config": None, "target_layer_ids": [1, 14, 26]}),
    Case("Partial(sum)", "TP 3 with --enable-flashinfer-allreduce-fusion on SGLang 0.5.12: the capture is each "
                         "rank's partial sum (rank 0's feeds its draft)",
         ("--server", "sglang@0.5.12", "--tp", "3", "--enable-flashinfer-allreduce-fusion")),
    Case("Partial(sum) fixed", "the same flags on SGLang 0.5.23, whose capture is taken after the fused all-reduce",
         ("--server", "sglang@0.5.23", "--tp", "3", "--enable-flashinfer-allreduce-fusion")),
]


def draft_for(case: Case, tmp: Path) -> Path:
    if not case.edit:
        return DRAFT
    out = tmp / case.name.replace(" ", "-").replace("(", "").replace(")", "")
    out.mkdir()
    for f in DRAFT.glob("*.safetensors"):
        os.symlink(f, out / f.name)
    raw = json.loads((DRAFT / "config.json").read_text())
    for key, value in case.edit.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def run(case: Case, tmp: Path) -> dict:
    tpsim = str(Path(sys.executable).with_name("tpsim"))
    argv = [tpsim, "acceptance", "--model", "smollm2-135m", "--draft", str(draft_for(case, tmp)), *TRAIN, *case.argv,
            "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"{case.name}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout)
    return {"case": case.name, "what": case.what, "argv": ["tpsim", *argv[1:-1]], "exit": r.returncode,
            "seconds": round(took, 1), "answer_tokens_per_s": round(out["answer_tokens"] / took, 1), **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "acceptance-cpu.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            results.append(run(case, Path(tmp)))
            print(f"{case.name}: {results[-1]['trained']['acceptance_length']} -> "
                  f"{results[-1]['served']['acceptance_length']} ({results[-1]['seconds']} s)", file=sys.stderr)
    table = Table(title="AL trained vs served: smollm2-135m + smollm2-135m-eagle3, 12 prompts, k = 3")
    for col in ("case", "served capture", "AL trained", "AL served", "difference (noise)", "per position served", "s"):
        table.add_column(col)
    for r in results:
        t, s = r["trained"], r["served"]
        table.add_row(r["case"], s["failure"] or ", ".join(s["positions"]) + f" TP {s['tp']} {s['mode']}",
                      f"{t['acceptance_length']:.2f}",
                      "-" if s["acceptance_length"] is None else f"{s['acceptance_length']:.2f}",
                      "-" if r["difference"] is None else f"{r['difference']:+.2f} (±{r['noise']:.2f})",
                      "-" if s["per_position"] is None else " ".join(f"{x:.2f}" for x in s["per_position"]),
                      f"{r['seconds']}")
    Console(width=200).print(table)
    Path(args.out).write_text(json.dumps({
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
        "cpus": os.cpu_count(), "python": platform.python_version(), "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
