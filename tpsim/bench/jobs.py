"""Benchmark jobs: functions every rank runs through a RankPool or torchrun, like tpsim.run.jobs.

- `overhead_job`: capture vs no capture per TP degree (benchmarks/capture_overhead.py);
- `forward_sweep_job`: seconds per forward (and in its all-reduces) per token count at a TP degree
  (`tpsim.bench.scaling.tp_table`);
- `allreduce_job`: the all-reduce sweep (benchmarks/allreduce.py);
- `cuda_capture_job`: a capture on CUDA ranks with TF32 off (tests/test_gpu.py);
- `phased_job`: any job, with the time spent in named functions of its module (benchmarks/startup.py).
"""

from __future__ import annotations

import functools
import sys
import time

import torch
import torch.distributed as dist

from tpsim.bench.hf import strict_fp32
from tpsim.capture import Position, Recorder
from tpsim.config.loader import config_from_dict
from tpsim.layers import fused
from tpsim.parallel.launch import RankContext
from tpsim.run.jobs import DTYPES, build_model, routing_rows, run_captured
from tpsim.run.spec import input_ids_for
from tpsim.parallel.ops import Op


def timed_forward(model, ids: torch.Tensor, positions: list[Position] | None = None) -> tuple[float, list]:
    """(seconds, collective records) of one full forward (logits included) of this rank's model,
    with EAGLE-3 capture of `positions` (a fresh Recorder, timed up to and including its
    `concat()`) or without (None). The TP group meets at a barrier first so all ranks start
    together; the clock (time.perf_counter, after a CUDA synchronize) covers only the forward."""
    group = model.group
    if group.size > 1:
        dist.barrier(group=group.pg)
    group.tracer.clear()
    cuda = group.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(group.device)
    t0 = time.perf_counter()
    recorder = Recorder(positions) if positions is not None else None
    model(ids, recorder=recorder, logits=True)
    if recorder is not None:
        recorder.concat()
    if cuda:
        torch.cuda.synchronize(group.device)
    return time.perf_counter() - t0, list(group.tracer.records)


def overhead_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, seq_len: int, positions: list[str],
                 tp: int, warmup: int, repeats: int) -> dict | None:
    """Wall time of one full forward (logits included) on this rank at TP=`tp`, with EAGLE-3
    capture of `positions` (a fresh Recorder per forward, timed up to and including its
    `concat()`) and without (recorder=None).

    The two variants are interleaved in ABBA order so slow drift (thermal, other load) hits
    both equally. Before every timed forward the TP group meets at a barrier so all ranks start
    together; the clock (time.perf_counter) covers only the forward. Also returns the
    all-reduces of one captured forward (count and bytes of this rank's input), and whether a
    plain forward runs exactly the same collectives. None on ranks outside the first TP block.
    """
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype)
    ids = torch.tensor(input_ids_for(config, seed, seq_len), dtype=torch.long, device=group.device)

    def timed(capture: bool) -> tuple[float, list]:
        return timed_forward(model, ids, pos if capture else None)

    ctx.progress(f"TP={tp}: {warmup} warmup + {repeats} timed pairs, seq_len {seq_len}")
    for _ in range(warmup):
        timed(True)
        timed(False)
    with_capture, without = [], []
    for i in range(repeats):
        for capture in ((True, False) if i % 2 == 0 else (False, True)):
            seconds, records = timed(capture)
            (with_capture if capture else without).append(seconds)
            if capture:
                cap_records = records
            else:
                plain_records = records
    if repeats == 0:
        _, cap_records = timed(True)
        _, plain_records = timed(False)
    key = [(r.op, r.caller, r.bytes) for r in cap_records]
    return {
        "rank": ctx.rank, "tp": tp, "group_rank": group.rank,
        "with_capture_s": with_capture, "without_capture_s": without,
        "all_reduces": sum(r.op is Op.ALL_REDUCE for r in cap_records),
        "all_reduce_bytes": sum(r.bytes for r in cap_records if r.op is Op.ALL_REDUCE),
        "collectives": len(cap_records),
        "same_collectives": key == [(r.op, r.caller, r.bytes) for r in plain_records],
    }


def forward_sweep_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, tokens: list[int], tp: int, warmup: int,
                      repeats: int, time_all_reduces: bool = False) -> dict | None:
    """Seconds of one plain forward (logits included, no capture) on this rank at TP=`tp` for
    each token count, one model for all of them; the TP group meets at a barrier before every
    timed forward. Also the all-reduces (count, bytes of this rank's input) of one forward per
    token count and, with `time_all_reduces`, the seconds this rank waited for them in each timed
    forward (`Tracer.timed`). None on ranks outside the first TP block."""
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    group.tracer.timed = time_all_reduces  # the group outlives this job: switched off again below
    try:
        model = build_model(config, group, seed, dtype)
        rows = []
        for T in tokens:
            ids = torch.tensor(input_ids_for(config, seed, T), dtype=torch.long, device=group.device)
            ctx.progress(f"TP={tp}: {T} tokens, {warmup} warmup + {repeats} timed forwards")
            for _ in range(warmup):
                timed_forward(model, ids)
            seconds, ar_seconds, records = [], [], list(group.tracer.records)
            for _ in range(repeats):
                t, records = timed_forward(model, ids)
                seconds.append(t)
                ar_seconds.append(sum(r.seconds() or 0.0 for r in records if r.op is Op.ALL_REDUCE))
            rows.append({"tokens": T, "seconds": seconds, "all_reduce_seconds": ar_seconds,
                         "all_reduces": sum(r.op is Op.ALL_REDUCE for r in records),
                         "all_reduce_bytes": sum(r.bytes for r in records if r.op is Op.ALL_REDUCE),
                         "collectives": len(records)})
    finally:
        group.tracer.timed = False
    return {"rank": ctx.rank, "tp": tp, "group_rank": group.rank, "rows": rows}


def allreduce_job(ctx: RankContext, sizes: list[int], dtype: str, warmup: int, iters: int,
                  inner: int | None = None) -> dict:
    """A plain all-reduce sweep over the whole world (torch.distributed directly, no tracer).

    Per size: a check that the sum is right (rank r contributes r + 1 everywhere), then
    `warmup` untimed and `iters` timed samples on a zero-filled buffer. A sample starts after a
    barrier and times `inner` back-to-back all-reduces (CUDA events on a GPU, perf_counter on the
    CPU); its value is that time / inner. `inner` defaults to 64 MiB / size, clamped to 1..50, so
    a small all-reduce is not lost in the timer's resolution. Returns this rank's samples."""
    dev, world = ctx.device, ctx.world_size
    cuda = dev.type == "cuda"
    dt = DTYPES[dtype]

    def barrier():
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    rows = []
    for size in sizes:
        n = max(1, size // dt.itemsize)
        reps = inner or max(1, min(50, (64 << 20) // max(size, 1)))
        ctx.progress(f"all-reduce {size:,} bytes: check, {warmup} warmup + {iters} samples x {reps}")
        x = torch.full((n,), float(ctx.rank + 1), dtype=dt, device=dev)
        dist.all_reduce(x)
        correct = bool((x == world * (world + 1) / 2).all())
        x.zero_()
        samples = []
        for i in range(warmup + iters):
            barrier()
            if cuda:
                torch.cuda.synchronize(dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    dist.all_reduce(x)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(x)
                seconds = time.perf_counter() - t0
            if i >= warmup:
                samples.append(seconds / reps)
        rows.append({"bytes": n * dt.itemsize, "elements": n, "inner": reps, "correct": correct,
                     "seconds": samples})
        del x
    return {"rank": ctx.rank, "world": world, "device": str(dev), "backend": ctx.backend, "rows": rows}


def cuda_capture_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], positions: list[str],
                     tp: int, compiled: bool = False) -> dict | None:
    """tests/test_gpu.py: this rank's capture (moved to the CPU: CUDA tensors do not travel through
    the pool's queue), the device it ran on, its all-reduces and MoE routing, with TF32 off in
    this rank process (float32 comparisons across TP degrees need IEEE float32). `compiled`: the
    forward takes tpsim.layers.fused's compiled path (regions and kernels) at any token count."""
    if not ctx.participates(tp):
        return None
    strict_fp32()
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype, kernels=fused.KernelPolicy(compiled, min_tokens=1))
    capture, logits = run_captured(model, input_ids, [Position.parse(p, config.num_hidden_layers) for p in positions])
    records = list(group.tracer.records)
    try:  # the experts each token picked per MoE layer, to leave routing near-ties out of comparisons
        picked = {k: v.cpu() for k, v in routing_rows(model).items()}
    except Exception:  # noqa: BLE001 (a MoE that no longer records its choice)
        picked = None
    return {"rank": ctx.rank, "group_rank": group.rank, "device": str(capture.device), "capture": capture.cpu(),
            "logits_finite": bool(torch.isfinite(logits).all()), "routing": picked,
            "all_reduces": sum(r.op is Op.ALL_REDUCE for r in records)}


def phased_job(ctx: RankContext, job, functions: list[str], **kwargs) -> tuple[object, dict[str, float]]:
    """(job's result, {name: seconds spent in it}) for functions of the job's module the job calls
    by name: each is wrapped in a timer for the one run (no profiler: its overhead would be timed)."""
    module = sys.modules[job.__module__]
    spent = dict.fromkeys(functions, 0.0)
    saved = {name: getattr(module, name) for name in functions}

    def timed(name, fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return run

    for name, fn in saved.items():
        setattr(module, name, timed(name, fn))
    try:
        return job(ctx, **kwargs), spent
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
