"""Jobs that run on every rank: build the model at a TP degree, run it, capture, compare.

Each job is `fn(ctx, **kwargs)`; kwargs are plain picklable values (the config as a dict,
ids as lists) so the same job runs in a self-spawned pool or under torchrun.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpsim.capture import Position, Recorder
from tpsim.capture.points import Taps
from tpsim.checkpoint import Checkpoint, load_weights
from tpsim.config import ModelConfig, config_from_dict
from tpsim.model import DeepseekForCausalLM, split_sizes
from tpsim.modes import Mode
from tpsim.parallel.group import TPGroup
from tpsim.parallel.consistency import agree
from tpsim.parallel.launch import RankContext
from tpsim.weights import init_random_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: ModelConfig, group: TPGroup, seed: int, dtype: str,
                checkpoint: str | None = None, progress=None, mode: Mode = Mode()) -> DeepseekForCausalLM:
    """This rank's shard of the model in `mode`: weights from the checkpoint directory when
    given (read slice by slice), else seeded from `seed`."""
    model = DeepseekForCausalLM(cfg, group, DTYPES[dtype], mode)
    if checkpoint is None:
        init_random_weights(model, seed, progress)
    else:
        load_weights(model, Checkpoint(checkpoint), progress)
    return model


def input_ids_for(cfg: ModelConfig, seed: int, seq_len: int) -> list[int]:
    """Random token ids drawn from `seed` (the same on every rank and every run)."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.randint(0, cfg.vocab_size, (seq_len,), generator=g).tolist()


def run_captured(model: DeepseekForCausalLM, input_ids: list[int], positions: list[Position],
                 strategy: str = "model-level"):
    """One forward: (this rank's capture `[T, len(positions) * hidden]` taken with `strategy`,
    logits `[T, vocab_size]`). Afterwards the group's tracer holds exactly the collectives of
    this forward."""
    parts, logits = run_captured_parts(model, input_ids, positions, strategy)
    return torch.cat(parts, dim=-1), logits


def run_captured_parts(model: DeepseekForCausalLM, input_ids: list[int], positions: list[Position],
                       strategy: str = "model-level"):
    """As run_captured, with the capture as one tensor per position (their token counts may differ)."""
    group = model.group
    group.tracer.clear()
    recorder = Recorder(positions, strategy)
    logits = model(torch.tensor(input_ids, dtype=torch.long, device=group.device), recorder=recorder)
    return recorder.parts(), logits


def own_tokens(input_ids: list[int], mode: Mode, group: TPGroup) -> list[int]:
    """The tokens this rank feeds the model: all of them, or under dp-attention its own
    sequence (contiguous chunk `group.rank` of `split_sizes(T, tp)`)."""
    if mode.name != "dp-attention" or group.size == 1:
        return input_ids
    sizes = split_sizes(len(input_ids), group.size)
    start = sum(sizes[:group.rank])
    return input_ids[start:start + sizes[group.rank]]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so a NaN equals the same NaN, unlike torch.equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ (Frobenius, in float64)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def agree_on_run(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], spec,
                 checkpoint: str | None, mode: dict | None = None) -> None:
    """Every rank checks that every other rank is about to run the same thing."""
    weights = {"checkpoint": Checkpoint(checkpoint).fingerprint()} if checkpoint else {"seed": seed}
    agree(ctx.world_size, {"config": cfg, "weights": weights, "input ids": input_ids, "dtype": dtype,
                           "mode": Mode.from_dict(mode).to_dict(), "capture spec": spec})


def _progress(ctx: RankContext, tp: int):
    ranks = f"{tp} rank{'s' if tp > 1 else ''}"
    return lambda msg: ctx.progress(f"TP={tp} on {ranks}: {msg}")


def check_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int],
              positions: list[str], tps: list[int], checkpoint: str | None = None, mode: dict | None = None,
              strategy: str | None = None) -> list[dict]:
    """For each TP degree this rank takes part in: capture in `mode` with `strategy`, then
    compare against this group's rank 0 (exact) and against the TP=1 capture of this rank's
    tokens (relative error; logits too). A capture that differs between ranks is gathered on
    the group's rank 0 and diagnosed there (tpsim.diagnose) against the TP=1 reference."""
    m = Mode.from_dict(mode)
    strategy = m.strategy(strategy)
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"positions": positions, "tps": tps, "strategy": strategy},
                 checkpoint, mode)
    config = config_from_dict(cfg)
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    residual_points = {p: f"layers.{p.layer}.mid" for p in pos if p.kind == "out"}
    reference, rows, replica = None, [], None
    for tp in sorted(set(tps) | {1}):
        if not ctx.participates(tp):
            continue
        group = ctx.groups[tp]
        group.taps = Taps(wanted=set(residual_points.values()) if tp == 1 else set(), watch_finite=True)
        try:
            model = build_model(config, group, seed, dtype, checkpoint, _progress(ctx, tp), m if tp > 1 else Mode())
            ctx.progress(f"TP={tp}: forward")
            parts, logits = run_captured_parts(model, own_tokens(input_ids, m, group), pos,
                                               strategy if tp > 1 else "model-level")
        finally:
            taps, group.taps = group.taps, None
        records = list(group.tracer.records)
        del model
        mixed = len({t.shape[0] for t in parts}) > 1  # a local capture of scattered and replicated positions
        cap = parts[0].new_zeros((0, 0)) if mixed else torch.cat(parts, dim=-1)
        if tp == 1:
            reference = {"capture": cap, "logits": logits,
                         "residual": {str(p): taps.got[n].tensor for p, n in residual_points.items()}}
        ref = reference
        if m.name == "dp-attention" and tp > 1:  # this rank's own sequence through a TP=1 replica
            if replica is None:
                replica = build_model(config, TPGroup(device=group.device), seed, dtype, checkpoint)
            c1, l1 = run_captured(replica, own_tokens(input_ids, m, group), pos)
            ref = {"capture": c1, "logits": l1, "residual": {}}
        identical, verdicts = _compare_ranks(group, parts, m, ref, pos)
        rows.append({
            "tp": tp, "rank": ctx.rank, "group_rank": group.rank, "group": list(group.ranks),
            "shape": list(cap.shape) if not mixed else [[t.shape[0] for t in parts], cap.shape[-1]],
            "identical": identical, "verdicts": verdicts,
            "finite": all(bool(torch.isfinite(t).all()) for t in parts), "first_nonfinite": taps.first_nonfinite,
            "rel_err": _rel_or_none(cap, ref and ref["capture"]),
            "logits_rel_err": _rel_or_none(logits, ref and ref["logits"]),
            "all_reduces": sum(r.op == "all_reduce" for r in records),
            "all_reduce_bytes": sum(r.bytes for r in records if r.op == "all_reduce"),
            "collectives": [(r.op, r.caller, r.bytes) for r in records],
        })
    return rows


def _rel_or_none(x: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    return rel_err(x, ref) if ref is not None and ref.shape == x.shape else None


def _compare_ranks(group: TPGroup, parts: list[torch.Tensor], mode: Mode, ref: dict | None,
                   positions: list[Position]):
    """(identical, verdicts): whether every rank of the group holds exactly group rank 0's
    capture (None under dp-attention, where each rank holds its own tokens), and when not, on
    the rank that has the TP=1 reference, tpsim.diagnose's verdict per position."""
    if group.size == 1 or mode.name == "dp-attention":
        return (None if group.size > 1 else True), None
    cap = torch.cat([t.flatten() for t in parts])
    shape = torch.tensor([t.shape[0] for t in parts], dtype=torch.long, device=cap.device)
    shapes = group.all_gather(shape, "check.capture_shapes", dim=0).view(group.size, -1)
    same_shape = bool((shapes == shapes[0]).all())
    identical = False
    if same_shape:
        first = group.broadcast(cap.clone(), "check.rank_identity")
        flag = torch.tensor([int(bitwise_equal(cap, first))], device=cap.device)
        identical = int(group.all_reduce(flag, "check.rank_identity").item()) == group.size
    if identical:
        return True, None
    every = [None] * group.size  # the ranks' captures, for the diagnosis (only when they differ)
    dist.all_gather_object(every, [t.cpu() for t in parts], group=group.pg)
    if ref is None or group.rank != 0:
        return False, None
    from tpsim.diagnose import diagnose_tensors
    H = ref["capture"].shape[-1] // len(positions)
    verdicts = []
    for i, p in enumerate(positions):
        name = str(p)
        ranks = [c[i] for c in every]
        reference = {name: ref["capture"][:, i * H:(i + 1) * H].cpu()}
        residual = {name: ref["residual"][name].cpu()} if name in ref["residual"] else None
        v = diagnose_tensors(ranks, reference, name, residual=residual)
        verdicts.append({"position": name, "placement": v.placement, "correct": v.correct, "reason": v.reason})
    return False, verdicts


def capture_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int],
                positions: list[str], tp: int, checkpoint: str | None = None, mode: dict | None = None,
                strategy: str | None = None):
    """The capture of group rank 0 (on that rank; None elsewhere), after checking that every
    rank of the group holds exactly the same tensor. Under dp-attention every rank returns its
    own sequence's capture (identical is None)."""
    m = Mode.from_dict(mode)
    strategy = m.strategy(strategy)
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"positions": positions, "tp": tp, "strategy": strategy},
                 checkpoint, mode)
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype, checkpoint, _progress(ctx, tp), m)
    ctx.progress(f"TP={tp}: forward")
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    parts, _ = run_captured_parts(model, own_tokens(input_ids, m, group), pos, strategy)
    identical, _ = _compare_ranks(group, parts, m, None, pos)
    mine = torch.cat(parts, dim=-1).cpu() if identical is not False else None
    return {"identical": identical, "capture": mine if group.rank == 0 or identical is None else None,
            "rank": ctx.rank, "group_rank": group.rank, "group": list(group.ranks)}


def points_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], tp: int,
               points: list[str], everything: bool = False, checkpoint: str | None = None,
               weights: bool = True, mode: dict | None = None):
    """One forward at TP=tp with named points tapped. Per group rank: {name: Tap} (tensors for
    `points`; with `everything`, every point's shape and placement) and the collective trace.
    `weights=False` leaves the parameters uninitialised: shapes, placements and collectives
    are those of the real model, at the memory cost of the pages the forward touches."""
    agree_on_run(ctx, cfg, seed, dtype, input_ids, {"points": points, "tp": tp, "everything": everything},
                 checkpoint if weights else None, mode)
    m = Mode.from_dict(mode)
    if not ctx.participates(tp):
        return None
    config, group = config_from_dict(cfg), ctx.groups[tp]
    model = build_model(config, group, seed, dtype, checkpoint, _progress(ctx, tp), m) if weights \
        else DeepseekForCausalLM(config, group, DTYPES[dtype], m)
    ctx.progress(f"TP={tp}: forward")
    group.tracer.clear()
    group.taps = Taps(wanted=set(points), everything=everything)
    try:
        model(torch.tensor(own_tokens(input_ids, m, group), dtype=torch.long, device=group.device))
    finally:
        taps, group.taps = group.taps, None
    return {"rank": group.rank, "taps": taps.got,
            "collectives": [(r.op, r.caller, r.shape, r.dtype, r.bytes) for r in group.tracer.records]}
