"""Which communication mode a profiled engine is in, given how it was launched: the flags as served
plus the profile's own auto-enable rules, and what its capture does in that mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpsim.modes import ArFusion, DpAttention, EpOutput, ExpertParallel, Mode, Strategy, TensorParallel
from tpsim.profiles.cited import Cited
from tpsim.profiles.profile import Gather, Profile, Served, Site


@dataclass(frozen=True)
class ServedMode:
    """The mode and capture strategy tpsim replays, why, and the profile behaviours that decided
    it (each cited)."""

    mode: Mode
    strategy: Strategy
    why: list[str] = field(default_factory=list)
    decided_by: list[Cited] = field(default_factory=list)
    capture_field: str | None = None  # the behaviour that decides whether the capture holds the whole stream
    sound: object = None  # the value of that behaviour that does


def served_mode(profile: Profile, s: Served) -> ServedMode:
    b = profile.behaviour
    if s.dp_attention and s.tp > 1:
        return ServedMode(DpAttention(), Strategy.LOCAL, ["--enable-dp-attention: each rank runs its own requests "
                                                         "and captures them rank-locally"])
    if s.deepep and s.tp > 1:
        gather = b.scattered or Cited(Gather.LOCAL, b.site.source)
        return ServedMode(ExpertParallel(EpOutput.SCATTERED), gather.value.strategy,
                          ["--moe-a2a-backend deepep: experts split over ranks, the stream token-scattered after "
                           f"MoE layers (tpsim's all_to_all emulates DeepEP's dispatch/combine); the capture holds "
                           f"{gather.value.value}"], [gather], "scattered", Gather.GATHERED)
    fusion = b.fusion_auto
    auto = fusion is not None and fusion.value.on(s)
    if s.tp > 1 and (s.allreduce_fusion or auto):
        why = ("--enable-flashinfer-allreduce-fusion given" if s.allreduce_fusion else
               f"all-reduce fusion is auto-enabled: {fusion.value.value} ({s.gpu.value}, {s.nnodes} node"
               f"{'s' if s.nnodes > 1 else ''}, tp {s.tp})")
        where = b.site.value
        return ServedMode(ArFusion(), where.strategy,
                          [why, f"the capture is taken {where.value}"],
                          [c for c in (fusion if auto else None, b.site) if c is not None], "site", Site.AFTER_FUSED_ADD)
    why = "tp 1: no collective" if s.tp == 1 else (
        "plain TP: " + (f"all-reduce fusion stays off ({fusion.value.value})" if fusion is not None
                        else "the profile has no fusion rule"))
    return ServedMode(TensorParallel(), Site.BETWEEN_LAYERS.strategy, [why], [fusion] if fusion else [])


def fixed_in(profile: Profile, later: list[Profile], served: ServedMode) -> Profile | None:
    """The first later profile whose capture holds the whole reduced stream in this mode."""
    if served.capture_field is None:
        return None
    for q in later:
        c = getattr(q.behaviour, served.capture_field)
        if c is not None and c.value is served.sound:
            return q
    return None


