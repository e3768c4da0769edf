"""Jobs that run on every rank: build the model at a TP degree, run it, capture, compare.

Each job is `fn(ctx, spec, ...)`: the RunSpec the command built, as is, so the same job runs
in a self-spawned pool or under torchrun; it returns a typed result (tpsim.run.results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpsim.base.tensors import bitwise_equal
from tpsim.capture import Position, PositionKind, Recorder
from tpsim.capture.points import Taps
from tpsim.weights.reader import Checkpoint, load_weights
from tpsim.offline.diagnosis import diagnose_tensors
from tpsim.config.loader import ModelConfig
from tpsim.model.decoder import CausalLM
from tpsim.layers.fused import EAGER_POLICY, KernelPolicy
from tpsim.layers.moe import MoE, Routing
from tpsim.modes import Mode, Strategy, TensorParallel
from tpsim.parallel.group import CollectiveRecord, TPGroup
from tpsim.parallel.consistency import agree
from tpsim.parallel.context import PrefixCache
from tpsim.parallel.launch import RankContext
from tpsim.parallel.pipeline import Stage
from tpsim.run.reference import Reference, SameRun
from tpsim.run.results import CaptureResult, PointsResult, RankCheck, SlotVerdict
from tpsim.run.spec import RunSpec
from tpsim.weights.seeded import init_random_weights
from tpsim.parallel.ops import Op

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(cfg: ModelConfig, group: TPGroup, seed: int, dtype: str,
                checkpoint: str | None = None, progress=None, mode: Mode = TensorParallel(), stage: Stage | None = None,
                kernels: KernelPolicy = EAGER_POLICY) -> CausalLM:
    """This rank's shard of the model in `mode` (of its PP `stage`, when given): weights from the
    checkpoint directory when given (read slice by slice), else seeded from `seed`; its forwards on
    `kernels` (tpsim.layers.fused)."""
    model = CausalLM(cfg, group, DTYPES[dtype], mode, stage, kernels)
    if checkpoint is None:
        init_random_weights(model, seed, progress)
    else:
        load_weights(model, Checkpoint(checkpoint), progress)
    group.wait_loaded()
    return model


def spec_model(spec: RunSpec, group: TPGroup, progress=None, mode: Mode = TensorParallel(),
               stage: Stage | None = None) -> CausalLM:
    """build_model for a run: its model, weights, dtype and kernels."""
    return build_model(spec.cfg, group, spec.seed, spec.dtype, spec.checkpoint, progress, mode, stage,
                       KernelPolicy(spec.compiled))


def run_captured(model: CausalLM, input_ids: list[int], positions: list[Position],
                 strategy: Strategy = Strategy.MODEL_LEVEL, cache: PrefixCache | None = None):
    """One forward: (this rank's capture `[T, len(positions) * hidden]` taken with `strategy`,
    logits `[T, vocab_size]`). Afterwards the group's tracer holds exactly the collectives of
    this forward. `cache`: a filled prefix cache the tokens follow (prefill_cache)."""
    parts, logits = run_captured_parts(model, input_ids, positions, strategy, cache)
    return torch.cat(parts, dim=-1), logits


def run_captured_parts(model: CausalLM, input_ids: list[int], positions: list[Position],
                       strategy: Strategy = Strategy.MODEL_LEVEL, cache: PrefixCache | None = None):
    """As run_captured, with the capture as one tensor per position (their token counts may differ)."""
    recorder, logits = run_recorded(model, input_ids, positions, strategy, cache)
    return recorder.parts(), logits


def run_recorded(model: CausalLM, input_ids: list[int], positions: list[Position],
                 strategy: Strategy = Strategy.MODEL_LEVEL,
                 cache: PrefixCache | None = None) -> tuple[Recorder, torch.Tensor]:
    """One forward with a Recorder attached: (the recorder, after the forward; the logits)."""
    group = model.group
    group.tracer.clear()
    recorder = Recorder(positions, strategy)
    with model.probe.attach(recorder):
        logits = model(torch.tensor(input_ids, dtype=torch.long, device=group.device), cache=cache)
    return recorder, logits


def prefill_cache(model: CausalLM, input_ids: list[int], n: int) -> tuple[PrefixCache, list[int]]:
    """SGLang's prefill after a radix-cache hit of the first n tokens: (the cache, filled by a forward of
    those n tokens, heard by no capture; the tokens the prefill still runs, n..T-1)."""
    cache = PrefixCache(n)
    model(torch.tensor(input_ids[:n], dtype=torch.long, device=model.group.device), cache=cache, logits=False)
    return cache, input_ids[n:]


def own_tokens(input_ids: list[int], mode: Mode, group: TPGroup) -> list[int]:
    """The tokens this rank feeds the model: all of them, or under dp-attention its own
    sequence (contiguous chunk `group.rank` of `split_sizes(T, tp)`)."""
    return mode.own_tokens(input_ids, group.rank, group.size)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ (Frobenius, in float64)."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def agree_on_run(ctx: RankContext, spec: RunSpec, capture: dict, weights: bool = True) -> None:
    """Every rank checks that every other rank is about to run the same thing (under torchrun
    each rank built its spec from its own arguments and files)."""
    ckpt = spec.checkpoint if weights else None
    agree(ctx.world_size, {"config": spec.cfg.to_dict(),
                           "weights": {"checkpoint": Checkpoint(ckpt).fingerprint()} if ckpt else {"seed": spec.seed},
                           "fp8 blocks": spec.cfg.fp8_block, "compiled": spec.compiled,
                           "input ids": list(spec.tokens), "dtype": spec.dtype, "mode": spec.mode.to_dict(),
                           "pipeline": spec.pipeline and spec.pipeline.to_dict(), "capture spec": capture})


def _progress(ctx: RankContext, tp: int):
    ranks = f"{tp} rank{'s' if tp > 1 else ''}"
    return lambda msg: ctx.progress(f"TP={tp} on {ranks}: {msg}")


def check_job(ctx: RankContext, spec: RunSpec, tps: list[int]) -> list[RankCheck]:
    """For each TP degree this rank takes part in: capture in `mode` with `strategy`, then
    compare against this group's rank 0 (exact) and against the TP=1 capture of this rank's
    tokens (relative error; logits too). A capture that differs between ranks is gathered on
    the group's rank 0 and diagnosed there (tpsim.offline.diagnosis) against the TP=1 reference."""
    m, pos = spec.mode, list(spec.positions)
    agree_on_run(ctx, spec, {"positions": [str(p) for p in pos], "tps": tps, "strategy": spec.strategy.value,
                             "prefix cached": spec.prefix_cached})
    reference, rows, replica = None, [], None
    for tp in sorted(set(tps) | {1}):
        if not ctx.participates(tp):
            continue
        group = ctx.groups[tp]
        mine = own_tokens(list(spec.tokens), m, group)
        if tp == 1 and (m.tbo or spec.prefix_cached):  # the reference runs the whole batch at once; the TP=1
            # row replays the overlap or the cache hit too
            reference = tp1_reference(spec, group, mine)
        run, same_run = _checked_forward(ctx, spec, group, mine)
        if tp == 1 and reference is None:
            reference = Reference(run.capture, run.logits, run.routing, run.margins, run.residual)
        ref = reference
        if m.runs_own_tokens(tp):  # this rank's own sequence through a TP=1 replica
            if replica is None:
                replica = spec_model(spec, TPGroup(device=group.device))
            c1, l1 = run_captured(replica, mine, pos)
            ref = Reference(c1, l1, routing_rows(replica), routing_margins(replica), {})
        if spec.prefix_cached and ref is not None:  # the rows the suffix forward should hold
            ref = ref.after(spec.prefix_cached)
        rows.append(_rank_check(ctx, spec, group, run, ref, same_run))
    return rows


@dataclass
class _Checked:
    """One rank's forward at one degree, as check reads it."""

    parts: list[torch.Tensor]  # the capture, one tensor per position
    capture: torch.Tensor  # the parts side by side (`[0, 0]`: mixed token counts, which do not concatenate)
    mixed: bool  # a local capture of scattered positions next to gathered or replicated ones
    logits: torch.Tensor
    modified: list  # (position, what it holds now): the recorder's aliasing check
    missing: list[Position]
    records: list[CollectiveRecord]  # the forward's collectives
    routing: dict[int, torch.Tensor]
    margins: dict[int, torch.Tensor]
    first_nonfinite: tuple[str, int] | None
    residual: dict[str, torch.Tensor]  # TP=1: each out position's residual at its layer's middle


def _residual_points(positions) -> dict[Position, str]:
    """{out position: the point holding its layer's residual at the middle} (the diagnosis reads them)."""
    return {p: f"layers.{p.layer}.mid" for p in positions if p.kind is PositionKind.OUT}


def _residuals(taps: Taps, points: dict[Position, str]) -> dict[str, torch.Tensor]:
    return {str(p): taps.got[n].tensor for p, n in points.items() if n in taps.got}


def _checked_forward(ctx: RankContext, spec: RunSpec, group: TPGroup,
                     mine: list[int]) -> tuple[_Checked, SameRun | None]:
    """This rank's forward at its group's degree (TP=1: plain TP and the model-level capture, unless
    two-batch overlap), and with a naive strategy the right strategy's capture of the same run. With
    --prefix-cached the forward runs the tokens after the cached prefix."""
    m, tp, pos, points = spec.mode, group.size, list(spec.positions), _residual_points(spec.positions)
    model = spec_model(spec, group, _progress(ctx, tp), m if tp > 1 or m.tbo else TensorParallel())
    cache, mine = prefill_cache(model, mine, spec.prefix_cached) if spec.prefix_cached else (None, mine)
    same_run = None
    # what the naive capture should have been, same run (two-batch overlap: pure TP, every strategy replicated)
    if tp > 1 and spec.strategy != m.right_strategy and not m.tbo:
        with model.probe.attach(Taps(wanted=set(points.values()))) as taps:
            right, _ = run_captured_parts(model, mine, pos, m.right_strategy, cache)
        same_run = SameRun(right, _residuals(taps, points))
    with model.probe.attach(Taps(wanted=set(points.values()) if tp == 1 else set(), watch_finite=True)) as taps:
        ctx.progress(f"TP={tp}: forward")
        recorder, logits = run_recorded(model, mine, pos, spec.strategy if tp > 1 or m.tbo else Strategy.MODEL_LEVEL,
                                        cache)
        parts, modified, missing = recorder.parts(), recorder.modified(), recorder.missing()
    records = list(group.tracer.records)
    rows_mode, T = m if tp > 1 else TensorParallel(), len(spec.tokens)
    route, margins = routing_rows(model, rows_mode, group, T), routing_margins(model, rows_mode, group, T)
    mixed = len({t.shape[0] for t in parts}) > 1
    cap = parts[0].new_zeros((0, 0)) if mixed else torch.cat(parts, dim=-1) if parts \
        else logits.new_zeros((len(mine), 0))  # nothing captured (two-batch overlap's split layers)
    return _Checked(parts or [cap], cap, mixed, logits, modified, missing, records, route, margins,
                    taps.first_nonfinite, _residuals(taps, points)), same_run


def _rank_check(ctx: RankContext, spec: RunSpec, group: TPGroup, run: _Checked, ref: Reference | None,
                same_run: SameRun | None) -> RankCheck:
    """This rank's row at its group's degree: its capture against the group's rank 0 and against `ref`."""
    pos, cap, tp = list(spec.positions), run.capture, group.size
    # entries a routing near-tie flipped (rounding picks another expert) are not compared; a
    # flip across a wide router margin is a real difference and stays in the comparison
    excused, real = judge_flips(run.routing, ref.routing, run.margins, ref.margins, NEAR_TIE[spec.dtype]) \
        if ref is not None else ([], [])
    mask = comparable_rows(pos, spec.cfg.hidden_size, run.routing, ref.routing, cap.shape[0], excused) \
        if ref is not None and not run.mixed and cap.shape == ref.capture.shape else None
    flipped = min((f.token for f in excused), default=None)
    identical, verdicts = _compare_ranks(group, run.parts, spec.mode, same_run or ref, pos)
    at = None if mask is None else mask.to(cap.device)
    return RankCheck(
        tp=tp, rank=ctx.rank, group_rank=group.rank, group=list(group.ranks),
        shape=list(cap.shape) if not run.mixed else [[t.shape[0] for t in run.parts], cap.shape[-1]],
        identical=identical, verdicts=verdicts,
        finite=all(bool(torch.isfinite(t).all()) for t in run.parts), first_nonfinite=run.first_nonfinite,
        rel_err=None if mask is None or not mask.any() else rel_err(cap[at], ref.capture[at]),
        compared=None if mask is None else float(mask.float().mean()),
        logits_rel_err=_rel_or_none(run.logits[:flipped], None if ref is None else ref.logits[:flipped])
        if flipped != 0 else None,
        routing_flip=flipped,
        real_flip=(real[0].layer, real[0].token, real[0].margin) if real else None,
        modified=[(str(p), None if now is None else str(now)) for p, now in run.modified],
        missing=[str(p) for p in run.missing],
        all_reduces=sum(r.op is Op.ALL_REDUCE for r in run.records),
        all_reduce_bytes=sum(r.bytes for r in run.records if r.op is Op.ALL_REDUCE),
        collectives=[(r.op, r.caller, r.bytes) for r in run.records])


def tp1_reference(spec: RunSpec, group: TPGroup, mine: list[int]) -> Reference:
    """check's TP=1 reference, the whole batch in one piece (plain TP), when the TP=1 row itself runs
    another way (two-batch overlap)."""
    model = spec_model(spec, group)
    points = _residual_points(spec.positions)
    with model.probe.attach(Taps(wanted=set(points.values()))) as taps:
        parts, logits = run_captured_parts(model, mine, list(spec.positions))
    return Reference(torch.cat(parts, dim=-1), logits, routing_rows(model), routing_margins(model),
                     _residuals(taps, points))


def routing_rows(model: CausalLM, mode: Mode = TensorParallel(), group: TPGroup | None = None,
                 T: int = 0) -> dict[int, torch.Tensor]:
    """{MoE layer k: the experts each of this rank's tokens picked in the last forward `[T_own, top_k]`,
    sorted}: the whole batch, in token order (ep: gathered from the ranks' token shards; sp:
    padding dropped; dp-attention: this rank's own sequence's rows)."""
    return {k: _own_rows(r.ids.sort(-1).values, mode, group, T) for k, r in _routings(model).items()}


def routing_margins(model: CausalLM, mode: Mode = TensorParallel(), group: TPGroup | None = None,
                    T: int = 0) -> dict[int, torch.Tensor]:
    """{MoE layer k: `[T_own]` router margin of each token in the last forward} (rows as routing_rows)."""
    return {k: _own_rows(r.margin.unsqueeze(-1), mode, group, T).squeeze(-1) for k, r in _routings(model).items()}


def _routings(model: CausalLM) -> dict[int, Routing]:
    """{MoE layer k: its block's routing in the last forward}, of the DeepSeek-style MoE blocks (GPT-OSS
    blocks are left out: check has never compared their routing)."""
    return {layer.k: layer.mlp.routing for layer in model.model.layers if isinstance(layer.mlp, MoE)}


def _own_rows(rows: torch.Tensor, mode: Mode, group: TPGroup | None, T: int) -> torch.Tensor:
    return mode.routing_rows(rows, group, T) if group is not None and group.size > 1 else rows


# A flip is rounding only when the router's margin for that token (k-th pick minus the next
# score, in score units) is below this in one of the two runs: float32 moves scores by ~1e-7,
# bf16 by ~1e-3; a flip across a wider margin is a real difference, not noise.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


@dataclass(frozen=True)
class Flip:
    layer: int
    token: int
    margin: float  # the smaller of the two runs' margins for this token at this layer


def judge_flips(routing_a: dict, routing_b: dict, margins_a: dict, margins_b: dict,
                bound: float) -> tuple[list[Flip], list[Flip]]:
    """(excused, real): every token whose experts differ between two runs, in causal order. A flip
    that an earlier excused flip explains (an earlier layer, the same or an earlier token: causal
    attention carries it) is dropped; of the rest, a margin below `bound` in either run is a
    near-tie rounding tipped (excused), anything else is a real difference. A token the MoE never saw
    (ids -1: a dp-attention row left out of the gather) is no flip: its difference shows in the capture."""
    excused: list[Flip] = []
    real: list[Flip] = []
    for k in sorted(routing_a):
        a, b = routing_a[k].cpu(), routing_b[k].cpu()
        for t in ((a != b).any(-1) & (a >= 0).any(-1) & (b >= 0).any(-1)).nonzero().flatten().tolist():
            if any(f.layer < k and f.token <= t for f in excused):
                continue
            margin = min(float(margins_a[k][t]), float(margins_b[k][t]))
            (excused if margin < bound else real).append(Flip(k, t, margin))
    return excused, real


def comparable_rows(positions: list[Position], hidden: int, routing_a: dict, routing_b: dict, T: int,
                    excused: list[Flip] | None = None) -> torch.Tensor:
    """`[T, n * hidden]` mask of the capture entries that must agree across TP degrees.

    When rounding flips a near-tie in MoE layer k's top-k for token t, that token takes other
    experts (an O(1) change, as in any engine), and through causal attention so may every later
    token in later layers. Entries at positions after layer k, for tokens >= t, are excluded:
    for the `excused` flips only when given (check), else for the first flip of every layer.
    """
    mask = torch.ones(T, len(positions) * hidden, dtype=torch.bool)
    if excused is None:
        excused = [Flip(k, int(f[0]), 0.0) for k in routing_a
                   if len(f := (routing_a[k].cpu() != routing_b[k].cpu()).any(-1).nonzero())]
    for flip in excused:
        for i, p in enumerate(positions):
            if p.kind is PositionKind.FINAL or p.boundary > flip.layer:
                mask[flip.token:, i * hidden:(i + 1) * hidden] = False
    return mask


def _rel_or_none(x: torch.Tensor, ref: torch.Tensor | None) -> float | None:
    return rel_err(x, ref) if ref is not None and ref.shape == x.shape else None


def _compare_ranks(group: TPGroup, parts: list[torch.Tensor], mode: Mode, ref: Reference | SameRun | None,
                   positions: list[Position]):
    """(identical, verdicts): whether every rank of the group holds exactly group rank 0's
    capture (None under dp-attention, where each rank holds its own tokens), and when not, on
    the rank that has the TP=1 reference, tpsim.diagnose's verdict per position."""
    if group.size == 1 or mode.rank_local:
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
    every = group.all_gather_object([t.cpu() for t in parts], "check.diagnosis")  # only when the ranks differ
    if ref is None or group.rank != 0:
        return False, None
    slots = ref.slots(len(positions))
    verdicts = []
    for i, p in enumerate(positions):
        name = str(p)
        ranks = [c[i] for c in every]
        reference = {name: slots[i].cpu()}
        residual = {name: ref.residual[name].cpu()} if name in ref.residual else None
        v = diagnose_tensors(ranks, reference, name, residual=residual)
        verdicts.append(SlotVerdict(name, v.placement, v.correct, v.reason))
    return False, verdicts


def capture_job(ctx: RankContext, spec: RunSpec, tp: int) -> CaptureResult | None:
    """The capture of group rank 0 (on that rank; None elsewhere), after checking that every
    rank of the group holds exactly the same tensor. Under dp-attention every rank returns its
    own sequence's capture (identical is None)."""
    m, pos = spec.mode, list(spec.positions)
    agree_on_run(ctx, spec, {"positions": [str(p) for p in pos], "tp": tp, "strategy": spec.strategy.value})
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    model = spec_model(spec, group, _progress(ctx, tp), m)
    ctx.progress(f"TP={tp}: forward")
    parts, _ = run_captured_parts(model, own_tokens(list(spec.tokens), m, group), pos, spec.strategy)
    identical, _ = _compare_ranks(group, parts, m, None, pos)
    mine = torch.cat(parts, dim=-1).cpu() if identical is not False else None
    return CaptureResult(identical, mine if group.rank == 0 or identical is None else None, ctx.rank, group.rank,
                         list(group.ranks))


def points_job(ctx: RankContext, spec: RunSpec, tp: int, points: list[str], everything: bool = False,
               weights: bool = True) -> PointsResult | None:
    """One forward at TP=tp with named points tapped: this rank's {name: Tap} (tensors for
    `points`; with `everything`, every point's shape and placement) and the collective trace.
    `weights=False` leaves the parameters uninitialised: shapes, placements and collectives
    are those of the real model, at the memory cost of the pages the forward touches."""
    agree_on_run(ctx, spec, {"points": points, "tp": tp, "everything": everything}, weights)
    m = spec.mode
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    model = spec_model(spec, group, _progress(ctx, tp), m) if weights \
        else CausalLM(spec.cfg, group, DTYPES[spec.dtype], m, kernels=KernelPolicy(spec.compiled))
    ctx.progress(f"TP={tp}: forward")
    group.tracer.clear()
    with model.probe.attach(Taps(wanted=set(points), everything=everything)) as taps:
        model(torch.tensor(own_tokens(list(spec.tokens), m, group), dtype=torch.long, device=group.device))
    return PointsResult(group.rank, taps.got,
                        [(r.op, r.caller, r.shape, r.dtype, r.bytes) for r in group.tracer.records])
