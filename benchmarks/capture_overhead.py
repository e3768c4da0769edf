"""Cost of EAGLE-3 capture: forward time with and without a Recorder, per TP degree.

One pool of max(--tp) local ranks (gloo on CPU) runs `tpsim.bench.jobs.overhead_job` once per TP
degree. Per iteration the slowest rank's time counts (a TP forward ends when its last rank
does); the table shows the median over iterations of that, with and without capture.

    .venv/bin/python benchmarks/capture_overhead.py [--tp 1,2,4,8] [--seq-len 64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tpsim.base import ui
from tpsim.bench.jobs import overhead_job
from tpsim.profiles.conventions import CONVENTIONS, resolve
from tpsim.config.loader import load_config
from tpsim.base.errors import UsageError
from tpsim.base.atomic import write_json
from tpsim.parallel.pool import RankPool

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "configs" / "tiny.yaml"), help="YAML/JSON config or HF model dir")
    ap.add_argument("--tp", default="1,2,4,8", help="comma-separated TP degrees (each must divide the largest)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20, help="timed forwards per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed forwards per variant first")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--convention", default="sglang-ids", choices=CONVENTIONS, help="capture ids: its defaults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "capture_overhead.json"))
    args = ap.parse_args(argv)
    try:
        args.tps = sorted({int(x) for x in args.tp.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--tp {args.tp!r} must be comma-separated integers")
    if not args.tps or args.tps[0] < 1 or any(args.tps[-1] % t for t in args.tps):
        ap.error(f"--tp {args.tp}: positive degrees that all divide the largest ({args.tps[-1] if args.tps else '?'})")
    if args.seq_len < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--seq-len and --repeats must be at least 1, --warmup at least 0")
    return args


def summarize(tp: int, seq_len: int, results: dict) -> dict:
    """One table/JSON row from {rank: job result} (None on ranks outside the TP block)."""
    ranks = [r for r in results.values() if r is not None]
    assert len(ranks) == tp, f"TP={tp}: {len(ranks)} ranks answered"
    slowest_with = [max(r["with_capture_s"][i] for r in ranks) for i in range(len(ranks[0]["with_capture_s"]))]
    slowest_without = [max(r["without_capture_s"][i] for r in ranks)
                       for i in range(len(ranks[0]["without_capture_s"]))]
    med_with, med_without = statistics.median(slowest_with), statistics.median(slowest_without)
    first = min(ranks, key=lambda r: r["rank"])
    return {
        "tp": tp, "seq_len": seq_len,
        "median_with_capture_s": med_with, "median_without_capture_s": med_without,
        "ratio": med_with / med_without, "overhead_pct": (med_with / med_without - 1) * 100,
        # Median of the per-iteration ratios: the paired estimate, less sensitive to drift.
        "paired_overhead_pct": (statistics.median(w / o for w, o in zip(slowest_with, slowest_without)) - 1) * 100,
        "tokens_per_s_with_capture": seq_len / med_with, "tokens_per_s_without_capture": seq_len / med_without,
        "all_reduces_per_forward": first["all_reduces"], "all_reduce_bytes_per_forward": first["all_reduce_bytes"],
        "collectives_per_forward": first["collectives"],
        "capture_adds_no_collectives": all(r["same_collectives"] for r in ranks),
        "slowest_rank_with_capture_s": slowest_with, "slowest_rank_without_capture_s": slowest_without,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.model)
        for tp in args.tps:
            config.check_tp(tp)
    except UsageError as e:
        print(f"capture_overhead: {e}", file=sys.stderr)
        return 2
    L = config.num_hidden_layers
    res = resolve(args.convention, None, L)
    positions = [str(p) for p in res.positions]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    progress = ui.ProgressLine()
    rows = []
    t_start = time.perf_counter()
    with RankPool(world=args.tps[-1], on_progress=progress) as pool:
        for tp in args.tps:
            results = pool.run(overhead_job, cfg=config.to_dict(), seed=args.seed, dtype=args.dtype,
                               seq_len=args.seq_len, positions=positions, tp=tp, warmup=args.warmup,
                               repeats=args.repeats)
            rows.append(summarize(tp, args.seq_len, results))
    progress.stop()
    elapsed = time.perf_counter() - t_start

    model_name = Path(args.model).stem if Path(args.model).is_file() else Path(args.model).name
    title = (f"EAGLE-3 capture overhead: {model_name}, L={L}, seq_len {args.seq_len}, {args.dtype}, "
             f"{args.convention} default ids {res.internal} -> {res.positions_text}; "
             f"median of slowest rank over {args.repeats} repeats")
    ui.titled_table(title, ["TP", "with capture ms", "without ms", "overhead %", "paired %",
                                     "tok/s with", "tok/s without", "all-reduces/fwd", "all-reduce bytes/fwd"],
                             [[str(r["tp"]), f"{r['median_with_capture_s'] * 1e3:.2f}",
                               f"{r['median_without_capture_s'] * 1e3:.2f}", f"{r['overhead_pct']:+.1f}",
                               f"{r['paired_overhead_pct']:+.1f}", f"{r['tokens_per_s_with_capture']:,.0f}",
                               f"{r['tokens_per_s_without_capture']:,.0f}", str(r["all_reduces_per_forward"]),
                               f"{r['all_reduce_bytes_per_forward']:,}"] for r in rows])
    if not all(r["capture_adds_no_collectives"] for r in rows):
        ui.stdout.print("warning: a captured forward ran different collectives than a plain one")

    out = Path(args.out)
    write_json(out, {
        "benchmark": "capture_overhead",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"torch": torch.__version__, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch_threads_per_rank": 1,
                    # 1/5/15-min load averages: other work on the machine skews every timing.
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "config": {"name": model_name, "path": str(args.model), "sha256": config.sha256(), "num_hidden_layers": L},
        "settings": {"tp": args.tps, "seq_len": args.seq_len, "repeats": args.repeats, "warmup": args.warmup,
                     "dtype": args.dtype, "seed": args.seed, "device": "cpu", "backend": "gloo",
                     "world": args.tps[-1]},
        "capture": res.to_dict(),
        "wall_s": elapsed,
        "rows": rows,
    })
    print(f"wrote {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
