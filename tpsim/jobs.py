"""Jobs that run on every rank: build the model at a TP degree, run it, capture, compare.

Each job is `fn(ctx, **kwargs)`; kwargs are plain picklable values (the config as a dict,
ids as lists) so the same job runs in a self-spawned pool or under torchrun.
"""

from __future__ import annotations

import torch

from tpsim.capture import Position, Recorder
from tpsim.capture.points import Taps
from tpsim.checkpoint import Checkpoint, load_weights
from tpsim.config import ModelConfig, config_from_dict
from tpsim.model import DeepseekForCausalLM
from tpsim.parallel.group import TPGroup
from tpsim.parallel.consistency import agree
from tpsim.parallel.launch import RankContext
from tpsim.weights import init_random_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: ModelConfig, group: TPGroup, seed: int, dtype: str,
                checkpoint: str | None = None, progress=None) -> DeepseekForCausalLM:
    """This rank's shard of the model: weights from the checkpoint directory when given (read
    slice by slice), else seeded from `seed`."""
    model = DeepseekForCausalLM(cfg, group, DTYPES[dtype])
    if checkpoint is None:
        init_random_weights(model, seed, progress)
    else:
        load_weights(model, Checkpoint(checkpoint), progress)
    return model


def input_ids_for(cfg: ModelConfig, seed: int, seq_len: int) -> list[int]:
    """Random token ids drawn from `seed` (the same on every rank and every run)."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.randint(0, cfg.vocab_size, (seq_len,), generator=g).tolist()


def run_captured(model: DeepseekForCausalLM, input_ids: list[int], positions: list[Position]):
    """One forward: (this rank's capture `[T, len(positions) * hidden]`, logits `[T, vocab_size]`).
    Afterwards the group's tracer holds exactly the collectives of this forward."""
    group = model.group
    group.tracer.clear()
    recorder = Recorder(positions)
    logits = model(torch.tensor(input_ids, dtype=torch.long, device=group.device), recorder=recorder)
    return recorder.concat(), logits


def capture_once(cfg: ModelConfig, group: TPGroup, seed: int, dtype: str, input_ids: list[int],
                 positions: list[Position], checkpoint: str | None = None, progress=None) -> torch.Tensor:
    """Build the model at this group's TP degree and return this rank's capture."""
    model = build_model(cfg, group, seed, dtype, checkpoint, progress)
    if progress is not None:
        progress("forward")
    return run_captured(model, input_ids, positions)[0]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so a NaN equals the same NaN, unlike torch.equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ (Frobenius, in float64)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def agree_on_run(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], spec,
                 checkpoint: str | None) -> None:
    """Every rank checks that every other rank is about to run the same thing."""
    weights = {"checkpoint": Checkpoint(checkpoint).fingerprint()} if checkpoint else {"seed": seed}
    agree(ctx.world_size, {"config": cfg, "weights": weights, "input ids": input_ids, "dtype": dtype,
                           "mode": "tp", "capture spec": spec})


def _progress(ctx: RankContext, tp: int):
    ranks = f"{tp} rank{'s' if tp > 1 else ''}"
    return lambda msg: ctx.progress(f"TP={tp} on {ranks}: {msg}")


def check_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int],
              positions: list[str], tps: list[int], checkpoint: str | None = None) -> list[dict]:
    """For each TP degree this rank takes part in: capture, then compare against this group's
    rank 0 (exact) and against the TP=1 capture of this rank (relative error)."""
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"positions": positions, "tps": tps}, checkpoint)
    config = config_from_dict(cfg)
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    reference, rows = None, []
    for tp in sorted(set(tps) | {1}):
        if not ctx.participates(tp):
            continue
        group = ctx.groups[tp]
        group.taps = Taps(watch_finite=True)
        try:
            cap = capture_once(config, group, seed, dtype, input_ids, pos, checkpoint, _progress(ctx, tp))
        finally:
            taps, group.taps = group.taps, None
        records = list(group.tracer.records)
        if tp == 1:
            reference = cap
        first = group.broadcast(cap.clone(), "check.rank_identity")
        rows.append({
            "tp": tp, "rank": ctx.rank, "group_rank": group.rank, "group": list(group.ranks),
            "shape": list(cap.shape), "identical": bitwise_equal(cap, first),
            "finite": bool(torch.isfinite(cap).all()), "first_nonfinite": taps.first_nonfinite,
            "rel_err": rel_err(cap, reference) if reference is not None else None,
            "all_reduces": sum(r.op == "all_reduce" for r in records),
            "all_reduce_bytes": sum(r.bytes for r in records if r.op == "all_reduce"),
            "collectives": [(r.op, r.caller, r.bytes) for r in records],
        })
    return rows


def capture_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int],
                positions: list[str], tp: int, checkpoint: str | None = None):
    """The capture of group rank 0 (on that rank; None elsewhere), after checking that every
    rank of the group holds exactly the same tensor."""
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"positions": positions, "tp": tp}, checkpoint)
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    cap = capture_once(config, group, seed, dtype, input_ids,
                       [Position.parse(p, config.num_hidden_layers) for p in positions], checkpoint, _progress(ctx, tp))
    first = group.broadcast(cap.clone(), "capture.rank_identity")
    same = torch.tensor([int(bitwise_equal(cap, first))], device=cap.device)
    group.all_reduce(same, "capture.rank_identity")
    return {"identical": int(same.item()) == tp, "capture": cap.cpu() if group.rank == 0 else None,
            "rank": ctx.rank, "group": list(group.ranks)}


def points_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], tp: int,
               points: list[str], everything: bool = False, checkpoint: str | None = None,
               weights: bool = True):
    """One forward at TP=tp with named points tapped. Per group rank: {name: Tap} (tensors for
    `points`; with `everything`, every point's shape and placement) and the collective trace.
    `weights=False` leaves the parameters uninitialised: shapes, placements and collectives
    are those of the real model, at the memory cost of the pages the forward touches."""
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"points": points, "tp": tp, "everything": everything},
                 checkpoint if weights else None)
    if not ctx.participates(tp):
        return None
    config, group = config_from_dict(cfg), ctx.groups[tp]
    model = build_model(config, group, seed, dtype, checkpoint, _progress(ctx, tp)) if weights \
        else DeepseekForCausalLM(config, group, DTYPES[dtype])
    ctx.progress(f"TP={tp}: forward")
    group.tracer.clear()
    group.taps = Taps(wanted=set(points), everything=everything)
    try:
        model(torch.tensor(input_ids, dtype=torch.long, device=group.device))
    finally:
        taps, group.taps = group.taps, None
    return {"rank": group.rank, "taps": taps.got,
            "collectives": [(r.op, r.caller, r.shape, r.dtype, r.bytes) for r in group.tracer.records]}
