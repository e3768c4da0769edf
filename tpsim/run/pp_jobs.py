"""`check` under pipeline parallelism: for each TP degree, the pp * tp ranks run the model split
into stages (stage s on ranks s*tp .. s*tp+tp-1), the capture is handled as the run's `Handoff`
says, and the last stage's ranks compare what reaches the draft, and the logits, with the whole
model at TP=1, PP=1 run on that rank."""

from __future__ import annotations

import torch

from tpsim.capture import Position, Recorder
from tpsim.capture.pipeline import collect
from tpsim.model.decoder import CausalLM
from tpsim.modes import Strategy, TensorParallel
from tpsim.parallel.group import TPGroup
from tpsim.parallel.launch import RankContext
from tpsim.run.jobs import DTYPES, _compare_ranks, _progress, agree_on_run, rel_err, run_captured_parts, spec_model
from tpsim.run.results import RankCheck
from tpsim.run.spec import RunSpec
from tpsim.parallel.ops import Op


def pp_forward(model: CausalLM, input_ids: list[int], positions: list[Position], spec: RunSpec,
               strategy: Strategy) -> tuple[list[tuple[Position, torch.Tensor]] | None, torch.Tensor | None]:
    """One forward of this rank's stage: (the slots that reach the draft, logits) on the last
    stage, (None, None) elsewhere. The group's tracer holds this forward's model traffic."""
    group, stage, cfg = model.group, model.stage, model.config
    every = spec.pipeline.stages(cfg.num_hidden_layers, group.size)
    group.tracer.clear()
    recorder = Recorder(positions, strategy)
    with model.probe.attach(recorder):
        logits = model(torch.tensor(input_ids, dtype=torch.long, device=group.device))
    slots = collect(recorder, group, stage, every, spec.pipeline.handoff, (len(input_ids), cfg.hidden_size),
                    DTYPES[spec.dtype])
    return slots, logits


def pp_check_job(ctx: RankContext, spec: RunSpec, tps: list[int]) -> list[RankCheck]:
    """For each TP degree: this rank's stage, its collectives, and on the last stage what reached
    the draft compared with the whole model at TP=1, PP=1 (every slot that arrived; the missing
    ones are named in `slots`)."""
    pipe, pos, ids = spec.pipeline, list(spec.positions), list(spec.tokens)
    agree_on_run(ctx, spec, {"positions": [str(p) for p in pos], "tps": tps, "strategy": spec.strategy.value})
    cfg, rows, reference = spec.cfg, [], None
    for tp in sorted(tps):
        peers = ctx.pipeline_group(tp)  # on every rank of the world, in the same order
        if not ctx.in_pipeline(tp, pipe.size):
            continue
        group = ctx.groups[tp]
        group.p2p_pg = peers
        stage = pipe.stages(cfg.num_hidden_layers, tp)[ctx.rank // tp]
        model = spec_model(spec, group, _progress(ctx, tp), TensorParallel(), stage)
        ctx.progress(f"PP={pipe.size} x TP={tp}: forward")
        slots, logits = pp_forward(model, ids, pos, spec, spec.strategy)
        records = list(group.tracer.records)
        del model
        common = dict(tp=tp, rank=ctx.rank, group_rank=group.rank, group=list(group.ranks), real_flip=None,
                      routing_flip=None, first_nonfinite=None, stage=stage.index,
                      all_reduces=sum(r.op is Op.ALL_REDUCE for r in records),
                      all_reduce_bytes=sum(r.bytes for r in records if r.op is Op.ALL_REDUCE),
                      collectives=[(r.op, r.caller, r.bytes) for r in records])
        if not stage.last:
            rows.append(RankCheck(shape=[], identical=None, verdicts=None, finite=True, rel_err=None, compared=None,
                                  logits_rel_err=None, **common))
            continue
        if reference is None:  # the whole model at TP=1, PP=1, on this rank alone
            whole = spec_model(spec, TPGroup(device=group.device))
            parts, ref_logits = run_captured_parts(whole, ids, pos)
            reference = {"parts": dict(zip(pos, parts)), "logits": ref_logits}
            del whole
        got = [p for p, _ in slots]
        parts = [t for _, t in slots]
        cap = torch.cat(parts, dim=-1) if parts else logits.new_zeros((len(ids), 0))
        ref = torch.cat([reference["parts"][p] for p in got], dim=-1) if got else cap
        identical, verdicts = _compare_ranks(group, parts, TensorParallel(), None, got) if parts else (True, None)
        rows.append(RankCheck(shape=list(cap.shape), identical=identical, verdicts=verdicts,
                              finite=all(bool(torch.isfinite(t).all()) for t in parts),
                              rel_err=rel_err(cap, ref) if got else None, compared=1.0,
                              logits_rel_err=rel_err(logits, reference["logits"]),
                              slots=[str(p) for p in got], **common))
    return rows
