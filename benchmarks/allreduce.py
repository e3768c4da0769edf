"""All-reduce sweep: time and bus bandwidth of a plain all-reduce from 1 MiB to 1 GiB.

    torchrun --nproc-per-node 8 benchmarks/allreduce.py                  # NCCL, one GPU per rank
    python benchmarks/allreduce.py --world 2                             # self-spawned (NCCL on CUDA)
    python benchmarks/allreduce.py --device cpu --world 2 --max-size 4MiB   # gloo, for testing

Sizes are the powers of 2 from --min-size (1 MiB) to --max-size (1 GiB) of one rank's bf16
buffer (--dtype). Per size, every rank first checks the sum (rank r contributes r + 1), then
runs --warmup untimed and --iters timed samples; a sample starts after a barrier and times
`inner` back-to-back `dist.all_reduce` calls on the whole world (CUDA events on a GPU,
time.perf_counter on the CPU; inner = 64 MiB / size clamped to 1..50, or --inner), so one
all-reduce is sample / inner. Per sample the slowest rank counts; the table shows the median
over samples (and min/max):

    algbw = bytes / time          busbw = 2 (n - 1) / n * bytes / time      (n ranks; nccl-tests' definition)

busbw is what each link carries in a ring all-reduce, comparable across n (0 at n = 1).

NVLink multicast (NVLS) stays off: this sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1
and NVSHMEM_DISABLE_NVLS=1 with os.environ.setdefault before any process group starts
(`tpsim.parallel.launch.MULTICAST_OFF`, set when that module is imported; a program that uses
multicast can take a shared host's GPUs out of service). Every process group
has a collective timeout (--timeout, default 300 s): a stalled rank fails the run, not hangs it.

Output: a table on stdout (rank 0), progress on stderr, and JSON in
benchmarks/results/allreduce-{device}-{n}.json (--out to override).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tpsim.base import ui  # noqa: E402
from tpsim.bench.jobs import allreduce_job  # noqa: E402
from tpsim.base.errors import RankError, UsageError  # noqa: E402
from tpsim.base.atomic import write_json  # noqa: E402
from tpsim.parallel import launch, torchrun  # noqa: E402
from tpsim.parallel.pool import RankPool  # noqa: E402  (launch's import turns NVLink multicast off: launch.MULTICAST_OFF)

NVLS_ENV = tuple(launch.MULTICAST_OFF)
UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4MiB, 1GiB or 1048576")
    n = int(m.group(1)) * UNITS[m.group(2).lower()]
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return n


def human(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--backend", default=None, help="default: nccl on CUDA, gloo on CPU")
    ap.add_argument("--world", type=int, default=None,
                    help="self-spawned ranks (without torchrun); default: the GPU count on CUDA, 2 on CPU")
    ap.add_argument("--min-size", type=parse_size, default=1 << 20)
    ap.add_argument("--max-size", type=parse_size, default=1 << 30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--iters", type=int, default=20, help="timed samples per size")
    ap.add_argument("--warmup", type=int, default=5, help="untimed samples per size")
    ap.add_argument("--inner", type=int, default=None, help="all-reduces per sample (default 64 MiB / size, 1..50)")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout of every process group, s")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/allreduce-{device}-{n}.json)")
    args = ap.parse_args(argv)
    if args.min_size > args.max_size:
        ap.error(f"--min-size {human(args.min_size)} exceeds --max-size {human(args.max_size)}")
    if args.iters < 1 or args.warmup < 0 or (args.inner is not None and args.inner < 1):
        ap.error("--iters and --inner must be at least 1, --warmup at least 0")
    if args.world is not None and args.world < 1:
        ap.error("--world must be at least 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available here; use --device cpu")
    args.backend = args.backend or launch.default_backend(args.device)
    return args


def sizes_between(lo: int, hi: int) -> list[int]:
    """Powers of 2 from lo (rounded up to one) to hi."""
    s = 1 << max(0, (lo - 1).bit_length())
    out = []
    while s <= hi:
        out.append(s)
        s <<= 1
    return out


def summarize(results: dict, world: int) -> list[dict]:
    ranks = [results[r] for r in sorted(results)]
    rows = []
    for i, first in enumerate(ranks[0]["rows"]):
        per = [r["rows"][i] for r in ranks]
        slowest = [max(p["seconds"][j] for p in per) for j in range(len(first["seconds"]))]
        t = statistics.median(slowest)
        b = first["bytes"]
        rows.append({"bytes": b, "elements": first["elements"], "inner": first["inner"],
                     "correct": all(p["correct"] for p in per), "median_s": t, "min_s": min(slowest),
                     "max_s": max(slowest), "algbw_gbps": b / t / 1e9,
                     "busbw_gbps": 2 * (world - 1) / world * b / t / 1e9, "slowest_rank_s": slowest})
    return rows


def report(args, rows: list[dict], world: int, device: str, backend: str, how: str, wall_s: float) -> Path:
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "launch": how, "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
           **{k: os.environ.get(k) for k in NVLS_ENV}}
    if device == "cuda":
        env.update({"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
                    "cuda": torch.version.cuda})
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            env["nccl"] = None
    title = (f"all-reduce: {world} ranks, {backend} on {env.get('gpu') or 'CPU'}, {args.dtype}; median of "
             f"{args.iters} samples (slowest rank each), busbw = 2(n-1)/n x bytes / time")
    ui.titled_table(title, ["size", "time us", "min-max us", "algbw GB/s", "busbw GB/s", "x/sample", "sum ok"],
                             [[human(r["bytes"]), f"{r['median_s'] * 1e6:,.1f}",
                               f"{r['min_s'] * 1e6:,.1f}-{r['max_s'] * 1e6:,.1f}", f"{r['algbw_gbps']:.2f}",
                               f"{r['busbw_gbps']:.2f}", str(r["inner"]), "yes" if r["correct"] else "NO"]
                              for r in rows])
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"allreduce-{device}-{world}.json")
    write_json(out, {
        "benchmark": "allreduce", "environment": env,
        "settings": {"world": world, "device": device, "backend": backend, "dtype": args.dtype, "iters": args.iters,
                     "warmup": args.warmup, "inner": args.inner, "timeout_s": args.timeout,
                     "min_size": args.min_size, "max_size": args.max_size},
        "formula": "algbw = bytes / time; busbw = 2 (n - 1) / n * bytes / time; time = median over samples of the "
                   "slowest rank's sample time / inner",
        "wall_s": wall_s, "rows": rows,
    })
    print(f"wrote {out.resolve()}")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sizes_between(args.min_size, args.max_size)
    if not sizes:
        print(f"allreduce: error: no power of 2 between {args.min_size} and {args.max_size} bytes", file=sys.stderr)
        return 2
    job = dict(sizes=sizes, dtype=args.dtype, warmup=args.warmup, iters=args.iters, inner=args.inner)
    t0 = time.perf_counter()
    if torchrun.under_torchrun():
        try:
            ctx = torchrun.init_from_env(args.device, args.backend, args.timeout)
        except UsageError as e:
            print(f"allreduce: error: {e}", file=sys.stderr)
            return 2
        mine = allreduce_job(ctx, **job)
        results = torchrun.gather_to_rank0(mine)
        if ctx.rank == 0:
            report(args, summarize(results, ctx.world_size), ctx.world_size, ctx.device.type, ctx.backend,
                   "torchrun", time.perf_counter() - t0)
        torchrun.exit_torchrun_rank(0)
        return 0
    world = args.world or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and args.backend == "nccl" and world > torch.cuda.device_count():
        print(f"allreduce: error: --world {world} NCCL ranks need {world} GPUs, this machine has "
              f"{torch.cuda.device_count()}; use --backend gloo to share GPUs", file=sys.stderr)
        return 2
    progress = ui.ProgressLine()
    try:
        with RankPool(world, backend=args.backend, device=args.device, timeout_s=args.timeout,
                             on_progress=progress) as pool:
            results = pool.run(allreduce_job, **job)
    except RankError as e:
        progress.stop()
        print(f"allreduce: {e}", file=sys.stderr)
        return 3
    progress.stop()
    report(args, summarize(results, world), world, args.device, args.backend, "self-spawned RankPool",
           time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
