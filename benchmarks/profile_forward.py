"""Where one tpsim forward spends its GPU time: kernels grouped by kind, per forward (CPU: operators).

Builds tpsim alone (seeded weights, TP=1, `tpsim.bench.hf.build_models`), runs `--warmup`
forwards with the capture (the `tpsim+capture` variant of benchmarks/forward.py), then
`--repeats` more under `torch.profiler`, and sums each CUDA kernel's time into a kind by its
name (`KINDS`: GEMM, attention, compiled kernels, sort/top-k, gathers, copies and casts, other
elementwise). Reported per forward: each kind's milliseconds and share of kernel time, the
kernels' sum against the wall time between CUDA events (the gap is launch latency and idle
GPU), the host's time to launch the forward (near the wall: the host bounds it), the top kernels
by time, and the GPU's longest idle stretches with the kernels around them. A breakdown, not a timing: the profiler adds its own overhead,
so the wall and host times are measured first, without it; the forward's time is
benchmarks/forward.py's to measure.

    python benchmarks/profile_forward.py                         # deepseek-v2-lite, 8192 tokens, compiled
    python benchmarks/profile_forward.py --tokens 4096 --no-compile
    python benchmarks/profile_forward.py --override num_hidden_layers=4 --tokens 512

Writes benchmarks/results/profile-{device}-{tokens}.json (or --out) and prints the tables.
Exit 0 when it ran, 2 on bad input.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.forward import add_model_args, environment, load_model_config, resolve_device  # noqa: E402
from tpsim.bench.hf import build_models  # noqa: E402
from tpsim.capture import Recorder  # noqa: E402
from tpsim.profiles.conventions import resolve  # noqa: E402
from tpsim.base.errors import UsageError  # noqa: E402
from tpsim.base.atomic import write_json  # noqa: E402
from tpsim.layers import fused  # noqa: E402
from tpsim.run.spec import input_ids_for  # noqa: E402

# (kind, substrings of a kernel name, lower case): the first kind with a match names the kernel. Every
# inductor kernel is "compiled", even one named after the GEMM or attention whose input it prepares
# (triton_poi_fused__grouped_mm_..._silu: silu * up written for the grouped GEMM); tpsim's own Triton GEMM
# (_expert_gate_up, tpsim.layers.triton_kernels) is a GEMM, its counting sort (_expert_counts, _starts, _places)
# a sort
KINDS = (
    ("compiled (triton)", ("triton",)),
    ("attention", ("fmha", "flash", "attention", "cudnn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "grouped", "matmul", "splitk", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::linear", "expert_gate_up")),
    ("sort / top-k", ("sort", "topk", "radix", "cub::", "expert_counts", "expert_starts", "expert_places")),
    ("gather / scatter", ("index", "gather", "scatter")),
    ("copy / cast", ("copy", "cat_", "catarray")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the one sequence")
    ap.add_argument("--repeats", type=int, default=3, help="profiled forwards")
    ap.add_argument("--warmup", type=int, default=3, help="forwards before profiling (compiles)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="tpsim.layers.fused's compiled kernels (default: on CUDA)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed")
    ap.add_argument("--host-profile", action="store_true", help="also cProfile the host's side of the forwards")
    ap.add_argument("--out", default=None, help="JSON path")
    return ap.parse_args(argv)


def breakdown(events, forwards: int, cuda: bool) -> tuple[list[dict], list[dict]]:
    """Kernel events (CUDA) or operators' own time (CPU) → (per kind, per name), milliseconds per
    forward, largest first."""
    kinds: dict[str, float] = {}
    names: dict[str, list] = {}
    for e in events:
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3 / forwards
        if ms <= 0:
            continue
        k = kind_of(e.key)
        kinds[k] = kinds.get(k, 0.0) + ms
        names.setdefault(e.key, [k, 0.0, 0])
        names[e.key][1] += ms
        names[e.key][2] += e.count // forwards
    total = sum(kinds.values()) or 1.0
    per_kind = [{"kind": k, "ms": ms, "share": ms / total} for k, ms in sorted(kinds.items(), key=lambda x: -x[1])]
    per_name = [{"kernel": n, "kind": k, "ms": ms, "calls": c, "share": ms / total}
                for n, (k, ms, c) in sorted(names.items(), key=lambda x: -x[1][1])]
    return per_kind, per_name


def idle_gaps(prof, top: int) -> dict:
    """The GPU's idle stretches between consecutive kernels (CUDA only): how many, their sum per
    forward boundary aside, and the `top` longest with the kernels on either side (where the host
    fell behind or waited)."""
    spans = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    gaps, end, before = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append(((start - end) / 1e3, before, name))
        if end is None or stop > end:
            end, before = stop, name
    longest = sorted(gaps, key=lambda g: -g[0])
    return {"count": len(gaps), "over_20us": sum(g[0] > 20 for g in gaps),
            "total_us": sum(g[0] for g in gaps), "longest": [{"us": us, "after": a, "before": b}
                                                             for us, a, b in longest[:top]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        cfg = load_model_config(args.model or ("deepseek-v2-lite" if device.type == "cuda" else "tiny"), args.override)
        if args.tokens < 1 or args.tokens > cfg.max_position_embeddings:
            raise UsageError(f"--tokens {args.tokens}: must be 1..max_position_embeddings={cfg.max_position_embeddings}")
        if args.repeats < 1:
            raise UsageError(f"--repeats {args.repeats}: must be at least 1")
        positions = resolve("sglang-ids", None, cfg.num_hidden_layers).positions  # the default capture, as forward.py's
    except UsageError as e:
        print(f"profile_forward: error: {e}", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    compiled = cuda if args.compile is None else args.compile
    model, _ = build_models(cfg, args.seed, dtype, device, transformers=False)
    model.kernels = fused.KernelPolicy(compiled, min_tokens=1)
    ids = torch.tensor(input_ids_for(cfg, args.seed, args.tokens), dtype=torch.long, device=device)

    def forward():
        rec = Recorder(positions)
        model(ids, recorder=rec, logits=True)
        return rec.concat()

    def timed() -> tuple[float, float]:
        """(wall ms between CUDA events, host ms to launch the forward: no sync inside)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        forward()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end), host

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    walls, hosts = [], []
    with torch.inference_mode():
        for _ in range(args.warmup):
            forward()
        if cuda:
            torch.cuda.synchronize(device)
            walls, hosts = zip(*(timed() for _ in range(args.repeats)))  # outside the profiler: its overhead is the host's
        if args.host_profile:
            stats = cProfile.Profile()
            stats.runcall(lambda: [forward() for _ in range(args.repeats)])
            pstats.Stats(stats).sort_stats("tottime").print_stats(args.top)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.repeats):
                forward()
            if cuda:
                torch.cuda.synchronize(device)
    per_kind, per_name = breakdown(prof.key_averages(), args.repeats, cuda)
    kernel_ms = sum(k["ms"] for k in per_kind)
    wall = statistics.median(walls) if walls else None
    result = {"benchmark": "profile_forward", "environment": environment(device), "model": cfg.model_type,
              "layers": cfg.num_hidden_layers, "tokens": args.tokens, "dtype": dtype, "compiled": compiled,
              "repeats": args.repeats, "wall_ms_median": wall,
              "host_ms_median": statistics.median(hosts) if hosts else None, "kernel_ms": kernel_ms,
              "kinds": per_kind, "kernels": per_name[:args.top]}
    if cuda:
        result["gaps"] = idle_gaps(prof, 12)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"profile-{device.type}-{args.tokens}.json")
    write_json(out, result)
    con = Console(width=140)
    t = Table(title=f"{'GPU' if cuda else 'CPU'} time per forward: {cfg.model_type} L={cfg.num_hidden_layers}, {args.tokens} tokens, {dtype}, "
                    f"{'compiled' if compiled else 'eager'}; {'kernels' if cuda else 'operators'} {kernel_ms:.1f} ms"
                    + (f", wall {wall:.1f} ms, host {statistics.median(hosts):.1f} ms (unprofiled)" if wall else ""))
    for c in ("kind", "ms", "share"):
        t.add_column(c, justify="left" if c == "kind" else "right")
    for k in per_kind:
        t.add_row(k["kind"], f"{k['ms']:.2f}", f"{100 * k['share']:.1f}%")
    con.print(t)
    t = Table(title=f"top {args.top} kernels")
    for c in ("kernel", "kind", "ms", "calls", "share"):
        t.add_column(c, justify="left" if c in ("kernel", "kind") else "right", overflow="fold")
    for k in per_name[:args.top]:
        t.add_row(k["kernel"][:90], k["kind"], f"{k['ms']:.2f}", str(k["calls"]), f"{100 * k['share']:.1f}%")
    con.print(t)
    if cuda:
        g = result["gaps"]
        t = Table(title=f"GPU idle between kernels, {args.repeats} forwards: {g['count']} gaps, "
                        f"{g['total_us'] / 1e3:.1f} ms in all, {g['over_20us']} over 20 us; the longest")
        for c in ("us", "after kernel", "before kernel"):
            t.add_column(c, justify="right" if c == "us" else "left", overflow="fold")
        for x in g["longest"]:
            t.add_row(f"{x['us']:.0f}", x["after"][:60], x["before"][:60])
        con.print(t)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
