"""Where the time of one `tpsim acceptance` goes (issue 54 deliver 3), on the real small target: SmolLM2-135M with
the built-in draft, its 12 prompts, k = 3, `--server vllm@0.32.0`. Each phase timed alone in this process (one
thread, as a rank runs), medians of --repeats, beside the whole command's wall in a fresh process:

- start: a fresh interpreter importing the command's modules;
- setup: the draft read and checked, the target's config and checkpoint, the prompts read and checked;
- rank pool: starting one gloo rank and running an empty job on it;
- target load: the target built from the converted checkpoint (what each rank does once per run);
- target forward: the 12 sequences, each one forward with the capture;
- draft load: the draft built on the target's embedding;
- draft chains: k steps over every row of the 12 sequences (one capture's acceptance);
- statistics: the rounds summed, the paired difference.

    .venv/bin/python benchmarks/acceptance_phases.py [--repeats 3] [--out benchmarks/results/acceptance-phases-cpu.json]

An acceptance served at TP 1 runs start + setup + rank pool + target load + target forward (the served capture
rides along with the trained one) + draft load + 2 x draft chains + statistics; served at TP > 1, one more pool,
load and forward at that TP; a sweep of n configurations (tpsim acceptance --sweep) one more per TP degree beyond
1, and the chains once per distinct capture. Exit 0 when it ran, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tpsim.app.acceptance import _measure, served_fed, trained_fed  # noqa: E402
from tpsim.app.acceptance_request import AcceptanceRequest, configured, setup  # noqa: E402
from tpsim.app.asks import EngineAsk  # noqa: E402
from tpsim.app.draft_served import target_embedding  # noqa: E402
from tpsim.app.triage import captures  # noqa: E402
from tpsim.bench.environment import git_commit  # noqa: E402
from tpsim.draft.acceptance import paired  # noqa: E402
from tpsim.draft.checkpoint import build  # noqa: E402
from tpsim.parallel.group import TPGroup  # noqa: E402
from tpsim.parallel.pool import RankPool  # noqa: E402
from tpsim.profiles.served import Served  # noqa: E402
from tpsim.run.acceptance import SequenceCapture  # noqa: E402
from tpsim.run.jobs import run_captured_parts, spec_model  # noqa: E402

SERVER, MODEL, DRAFT = "vllm@0.32.0", "smollm2-135m", "smollm2-135m-eagle3"
COMMAND = ["-m", "tpsim", "acceptance", "--model", MODEL, "--draft", DRAFT, "--server", SERVER, "--json"]


def _empty_job(ctx) -> None:
    return None


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def phases(repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    got: dict[str, float] = {}
    got["start"], _ = timed(lambda: subprocess.run([sys.executable, "-c", "import tpsim.cli.acceptance"],
                                                   check=True, cwd=ROOT), repeats)
    req = AcceptanceRequest(SERVER, EngineAsk(Served(server=SERVER)), DRAFT, MODEL)
    got["setup"], s = timed(lambda: setup(req), repeats)
    inputs = configured(req, s).trained
    caps = captures(inputs)
    fed = trained_fed(caps)
    spec, _ = inputs.request.spec(inputs.target.source, fed.positions, (fed.mode, fed.strategy))

    def pool():
        with RankPool(1, "gloo", "cpu", 120.0) as p:
            p.run(_empty_job)
    got["rank pool"], _ = timed(pool, repeats)
    group = TPGroup(device=torch.device("cpu"))
    got["target load"], model = timed(lambda: spec_model(spec, group), repeats)
    seqs = s.prompts.sequences

    def forward():
        with torch.no_grad():
            return [run_captured_parts(model, list(q.tokens), list(fed.positions), fed.strategy) for q in seqs]
    got["target forward"], outs = timed(forward, repeats)
    on_train = [SequenceCapture(torch.cat(parts, dim=-1), True, logits.argmax(-1).tolist()) for parts, logits in outs]
    embed = target_embedding(spec.source, spec.seed, spec.device).float()
    got["draft load"], draft = timed(lambda: build(s.checkpoint, embed, spec.device).eval(), repeats)
    served = served_fed(inputs, caps, s.checkpoint.config.capture_width)
    got["draft chains"], m = timed(lambda: _measure(draft, served, on_train, list(seqs), req.steps), repeats)
    got["statistics"], _ = timed(lambda: paired(m.acceptance, m.acceptance), repeats)
    return got


def whole(repeats: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return timed(lambda: subprocess.run([sys.executable, *COMMAND], check=True, cwd=ROOT, env=env,
                                        capture_output=True), repeats)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "acceptance-phases-cpu.json"))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        print("acceptance_phases: --repeats must be at least 1", file=sys.stderr)
        return 2
    before = os.getloadavg()
    got = phases(args.repeats)
    wall = whole(args.repeats)
    plain = (got["start"] + got["setup"] + got["rank pool"] + got["target load"] + got["target forward"]
             + got["draft load"] + 2 * got["draft chains"] + got["statistics"])
    print(f"{'phase':16} {'s':>8}")
    for name, s in got.items():
        print(f"{name:16} {s:8.2f}")
    print(f"{'sum, as run':16} {plain:8.2f}   (start + setup + pool + load + forward + draft load + 2 x chains "
          "+ statistics: TP 1)")
    print(f"{'whole command':16} {wall:8.2f}")
    result = {"benchmark": "acceptance_phases", "command": " ".join(["tpsim", *COMMAND[2:]]), "repeats": args.repeats,
              "phases_s": {k: round(v, 3) for k, v in got.items()}, "sum_as_run_s": round(plain, 3),
              "whole_command_s": round(wall, 3),
              "environment": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "torch": torch.__version__, "python": platform.python_version(),
                              "cpu_count": os.cpu_count(), "loadavg_before": before,
                              "loadavg_after": os.getloadavg(),
                              "git_commit": git_commit()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
