"""Benchmark jobs (run on every rank through a RankPool or torchrun, like tpsim.jobs)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tpsim.capture import Position, Recorder
from tpsim.config import config_from_dict
from tpsim.jobs import build_model, input_ids_for
from tpsim.parallel.launch import RankContext


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
    cuda = group.device.type == "cuda"

    def timed(capture: bool) -> tuple[float, list]:
        if group.size > 1:
            dist.barrier(group=group.pg)
        group.tracer.clear()
        if cuda:
            torch.cuda.synchronize(group.device)
        t0 = time.perf_counter()
        recorder = Recorder(pos) if capture else None
        model(ids, recorder=recorder, logits=True)
        if recorder is not None:
            recorder.concat()
        if cuda:
            torch.cuda.synchronize(group.device)
        return time.perf_counter() - t0, list(group.tracer.records)

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
        "all_reduces": sum(r.op == "all_reduce" for r in cap_records),
        "all_reduce_bytes": sum(r.bytes for r in cap_records if r.op == "all_reduce"),
        "collectives": len(cap_records),
        "same_collectives": key == [(r.op, r.caller, r.bytes) for r in plain_records],
    }
