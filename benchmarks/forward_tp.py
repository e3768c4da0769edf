"""Forward time per TP degree: one seeded model at TP 1, 2, 4, 8 over real collectives.

    python benchmarks/forward_tp.py                                  # CUDA: V2-Lite bf16, TP 1..GPU count, NCCL
    python benchmarks/forward_tp.py --allreduce benchmarks/results/allreduce-cuda-2.json
    python benchmarks/forward_tp.py --device cpu --tp 1,2,4 --tokens 16,64      # tiny over gloo

One self-spawned pool of max(--tp) ranks: NCCL with one GPU per rank on CUDA (a TP degree needing
more GPUs than the machine has is skipped, with the reason), gloo on the CPU. Every TP degree
builds the same seeded model (`tpsim.bench.jobs.forward_sweep_job`, ranks 0..tp-1) and times, per token
count (one sequence each), --warmup untimed and --repeats timed plain forwards (logits included,
no capture; the TP group meets at a barrier before each). Per forward the slowest rank counts;
the table shows the median over repeats:

    speedup(tp) = t(TP=1) / t(tp)          efficiency(tp) = speedup(tp) / tp

All-reduces per forward are counted from the collective trace (count, bytes of one rank's
input: 1 + 2L all-reduces of [T, hidden] in pure TP) and timed: each all-reduce sits between two
CUDA events on the compute stream (perf_counter on the CPU), so its time is what the forward
waits for it, a slower peer included. Summed per forward (mean over ranks, median over repeats):

    busbw(forward) = 2 (n - 1) / n * all-reduce bytes / all-reduce time    (n = tp)

With --allreduce (the JSON of `benchmarks/allreduce.py` run on the same machine, same world),
each all-reduce's size is looked up in that sweep (the row of the same bytes, else the nearest
size scaled by bytes) to give what the same all-reduces cost alone: sweep ms per forward and
sweep busbw, beside the measured ones.

NVLink multicast stays off (tpsim.parallel.launch sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before any process group starts).
Progress on stderr, the table on stdout, JSON in benchmarks/results/forward-tp-{device}-{n}.json.
Exit 0 when it ran, 2 on bad input, 3 when a rank failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .`

import torch  # noqa: E402

from benchmarks.forward import add_model_args, environment, int_list, load_model_config, resolve_device  # noqa: E402
from tpsim.base import ui  # noqa: E402
from tpsim.bench.scaling import tp_table  # noqa: E402
from tpsim.base.errors import RankError, UsageError  # noqa: E402
from tpsim.base.atomic import write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tp", default=None, help="TP degrees (default 1,2,4,8 up to the GPU count on CUDA; 1,2,4,8 "
                    "on CPU)")
    ap.add_argument("--tokens", default=None, help="token counts (default 4096,8192 on CUDA, 16,64,256 on CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per TP degree and token count")
    ap.add_argument("--warmup", type=int, default=2, help="untimed forwards before them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout of every process group, s")
    ap.add_argument("--allreduce", default=None, metavar="JSON",
                    help="benchmarks/allreduce.py's JSON from this machine, to compare the forward's all-reduces with")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/forward-tp-{device}-{n}.json)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be at least 1 and --warmup at least 0")
    return args


def sweep_seconds(sweep: list[dict], nbytes: int) -> tuple[float, int]:
    """(seconds, sweep size used) of one all-reduce of `nbytes` from the sweep's rows: the row of
    that size, else the nearest size's time scaled by the byte ratio (bandwidth-bound sizes)."""
    row = min(sweep, key=lambda r: abs(r["bytes"] - nbytes))
    return row["median_s"] * nbytes / row["bytes"], row["bytes"]


def compare_with_sweep(rows: list[dict], sweep: dict) -> None:
    """Add the sweep's time and bus bandwidth for each row's all-reduces (same world only)."""
    world = sweep["settings"]["world"]
    for r in rows:
        if r["tp"] != world or not r["all_reduces"]:
            continue
        per = r["all_reduce_bytes"] // r["all_reduces"]
        t, size = sweep_seconds(sweep["rows"], per)
        r["sweep"] = {"size_bytes": size, "exact": size == per, "seconds_per_all_reduce": t,
                      "seconds_per_forward": t * r["all_reduces"],
                      "busbw_gbps": 2 * (world - 1) / world * per / t / 1e9}


def print_table(result: dict) -> None:
    s = result["settings"]
    title = (f"forward per TP degree: {result['config']['name']} (L={result['config']['num_hidden_layers']}), "
             f"{s['dtype']}, {s['backend']} on {result['environment'].get('gpu') or 'CPU'}; median of {s['repeats']} "
             f"(slowest rank each); all-reduce time = what the forward waits for them")
    cols = ["TP", "tokens", "ms/forward", "speedup", "efficiency", "all-reduces", "MB/rank", "AR ms", "AR share",
            "busbw GB/s", "sweep AR ms", "sweep busbw"]
    out = []
    for r in result["table"]["rows"]:
        sw = r.get("sweep")
        ar_s = r.get("all_reduce_s")
        busbw = r.get("all_reduce_busbw_gbps")
        none = r["speedup"] is None  # no TP=1 row to compare with
        out.append([str(r["tp"]), str(r["tokens"]), f"{r['median_s'] * 1e3:.2f}",
                    "-" if none else f"{r['speedup']:.2f}x", "-" if none else f"{r['efficiency']:.0%}",
                    f"{r['all_reduces']} ({r['all_reduces_formula']})",
                    f"{r['all_reduce_bytes'] / 1e6:,.2f}", "-" if ar_s is None else f"{ar_s * 1e3:.2f}",
                    "-" if ar_s is None else f"{ar_s / r['median_s']:.0%}", "-" if busbw is None else f"{busbw:.3g}",
                    "-" if sw is None else f"{sw['seconds_per_forward'] * 1e3:.2f}",
                    "-" if sw is None else f"{sw['busbw_gbps']:.3g}" + ("" if sw["exact"] else "*")])
    ui.titled_table(title, cols, out)
    if any(not r.get("sweep", {"exact": True})["exact"] for r in result["table"]["rows"]):
        ui.stdout.print("* the sweep has no row of this size: the nearest size's time, scaled by bytes")
    for sk in result["table"]["skipped"]:
        ui.stdout.print(f"skipped TP={sk['tp']}: {sk['reason']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        cuda = device.type == "cuda"
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
        model = args.model or ("deepseek-v2-lite" if cuda else "tiny")
        cfg = load_model_config(model, args.override)
        gpus = torch.cuda.device_count() if cuda else 0
        tps = int_list(args.tp or ",".join(str(t) for t in (1, 2, 4, 8) if not cuda or t <= gpus), "--tp")
        tokens = int_list(args.tokens or ("4096,8192" if cuda else "16,64,256"), "--tokens")
        if max(tokens) > cfg.max_position_embeddings:
            raise UsageError(f"--tokens {max(tokens)} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        sweep = None
        if args.allreduce:
            try:
                sweep = json.loads(Path(args.allreduce).read_text())
                sweep["settings"]["world"], sweep["rows"][0]["median_s"]
            except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
                raise UsageError(f"--allreduce {args.allreduce}: not a benchmarks/allreduce.py result "
                                 f"({type(e).__name__}: {e}); run that script first") from None
    except UsageError as e:
        print(f"forward_tp: error: {e}", file=sys.stderr)
        return 2
    progress = ui.ProgressLine()
    t0 = time.perf_counter()
    try:
        table = tp_table(cfg, tps, tokens, dtype, args.seed, args.warmup, args.repeats, progress, device.type,
                         timeout_s=args.timeout)
    except UsageError as e:
        progress.stop()
        print(f"forward_tp: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        progress.stop()
        print(f"forward_tp: {e}", file=sys.stderr)
        return 3
    progress.stop()
    if sweep is not None:
        compare_with_sweep(table["rows"], sweep)
    name = Path(model).stem if Path(model).is_file() else Path(model).name
    result = {"benchmark": "forward_tp", "environment": environment(device),
              "config": {"name": name, "overrides": args.override, "sha256": cfg.sha256(),
                         "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size},
              "settings": {"device": device.type, "backend": table["backend"], "dtype": dtype, "tp": tps,
                           "tokens": tokens, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
                           "allreduce_sweep": args.allreduce},
              "formula": "speedup = t(TP=1) / t(tp); efficiency = speedup / tp; busbw = 2 (n - 1) / n * all-reduce "
                         "bytes / all-reduce time; t = median over repeats of the slowest rank's forward",
              "wall_s": time.perf_counter() - t0, "table": table}
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"forward-tp-{device.type}-{max(table['tps'])}.json")
    write_json(out, result)
    print_table(result)
    print(f"wrote {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
