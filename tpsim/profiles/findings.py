"""What a replay means for the draft: each way the engine's handling of the ids breaks the capture
(a silently dropped slot, a crash, a refusal), with the fix: the id that works, or the version
that has the fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.capture.positions import Position
from tpsim.profiles.profile import EmbedId, Numbering, Wiring
from tpsim.profiles.registry import later_profiles
from tpsim.profiles.inverse import ids_for_position
from tpsim.profiles.replay import Fate, Replay, Slot


class Kind(Enum):
    """What a finding is about; the value is its headline in `triage` and `resolve`."""

    CAPTURE_OFF = "capture turned off"
    ENGINE_FAILS = "the engine fails on these ids"
    DROPPED_SLOT = "a slot silently dropped"
    KEY_FALLBACK = "config key fallback"
    MISALIGNED = "train and serve capture different tensors"
    SERVED_MODE = "the served mode breaks the capture"
    GRAPH_IDS = "CUDA-graphed batches capture other ids"
    ENGINE_REFUSES = "the engine refuses this launch at start-up"
    PIPELINE = "pipeline parallelism moves or drops slots"
    IDS_CHANGED = "the config's ids were changed after training"
    CAPTURE_IGNORED = "the model file never captures"
    PREFIX_CACHE = "a prefix-cache hit feeds the draft a stale KV"
    UBATCH_MERGE = "the micro-batches cannot be merged with their aux states"
    PD_HANDOFF = "PD disaggregation hands the decode server a state wider or narrower than its buffer"
    ALGORITHM = "the served speculative algorithm is not the draft's"
    FC_SKIPPED = "the draft's fc is skipped"


@dataclass(frozen=True)
class Finding:
    """Something that breaks the draft's capture: what (`kind`), why, the sources that show the engine
    does this, and the fix."""

    kind: Kind
    cause: str
    sources: list[str]
    fix: str | None  # None: none that the command printing it has replayed
    replayed: bool = False  # triage applied the fix, re-ran the same replay and saw the finding clear

    def __str__(self) -> str:
        return self.cause if self.fix is None else f"{self.cause}; fix: {self.fix}"

    def to_dict(self) -> dict:
        return {"kind": self.kind.name.lower().replace("_", "-"), "title": self.kind.value, "cause": self.cause,
                "sources": self.sources, "fix": self.fix, "fix_replayed": self.replayed}


def replay_findings(rep: Replay, hidden: int | None = None) -> list[Finding]:
    """What the engine's handling of these ids does to the draft: its crash or refusal, and each slot
    it silently drops."""
    p, L = rep.profile, rep.num_layers
    if not p.behaviour.captures and rep.slots:
        return [_wiring(rep, hidden)]
    kind = Kind.ENGINE_FAILS if rep.failure else Kind.DROPPED_SLOT
    embed = any(s.fate is Fate.CRASHES for s in rep.slots)
    sources = [str(p.behaviour.embed.source if embed else p.behaviour.out_of_range.source)]
    out = []
    given = (f" ({p.engine}'s default ids {rep.ids} for {L} layers: the config names none)" if rep.used_default
             else "")
    if rep.crashed or rep.refused:
        out.append(Finding(kind, rep.failure + given + _patched_hint(rep), sources, _crash_fix(rep)))
    for s in rep.dropped:
        width = "" if hidden is None else f"; the capture is {rep.width_text(hidden)}"
        out.append(Finding(kind, f"slot {s.index}: id {s.id} becomes internal id {s.internal}, which {p.name}'s "
                           f"capture loop (layers 0..{L - 1}"
                           f"{', and after the last' if p.behaviour.last_boundary.value else ''}) never reaches: "
                           f"the slot is silently missing{width}{given}", sources, _dropped_fix(rep, s)))
    merged = [s for s in rep.slots if s.fate is Fate.MERGED]
    if merged and not rep.failure:
        width = "" if hidden is None else f": the capture is {rep.width_text(hidden)}"
        out.append(Finding(Kind.DROPPED_SLOT, f"slot{'s' * (len(merged) > 1)} {', '.join(str(s.index) for s in merged)}: "
                           f"ids {rep.ids} name {merged[0].position} more than once on {L} layers and {p.name} "
                           f"captures a repeated boundary once{width}{given}",
                           [str(p.behaviour.duplicates.source)], "give ids that name distinct layers"))
    return out


def _wiring(rep: Replay, hidden: int | None) -> Finding:
    """A model class that never takes the capture set: its forward ignores the ids (the draft gets no aux states),
    or setting them fails at start-up."""
    p, n, wiring = rep.profile, len(rep.slots), rep.profile.behaviour.wiring
    later = next((q for q in later_profiles(p) if q.behaviour.captures), None)
    fix = (f"serve with {later.name.split(':')[0]} or later ({later.versions.since.label}), whose model file "
           "captures" if later else f"no {p.engine} version tpsim read serves this model class with EAGLE-3")
    if wiring.value is Wiring.SETTER_REFUSES:
        return Finding(Kind.ENGINE_REFUSES, f"{p.name}: {wiring.value.value}: {rep.failure}", [str(wiring.source)], fix)
    width = "" if hidden is None else f" (its fc expects {n} x {hidden} = {n * hidden} per token)"
    then = f"; then {rep.failure}" if rep.failure else ", and no error is raised"
    return Finding(Kind.CAPTURE_IGNORED, f"{p.name}: {wiring.value.value}: 0 of {n} slots reach the draft{width}{then}",
                   [str(wiring.source)], fix)


def _dropped_fix(rep: Replay, s: Slot) -> str:
    p, L = rep.profile, rep.num_layers
    meant = Position.at_boundary(min(max(s.internal, 0), L))
    j = ids_for_position(p, meant, L)
    if j is not None and rep.ids and rep.ids[0] == 1 and p.behaviour.numbering.value is Numbering.PLUS_ONE_IF_FIRST_IS_1:
        j = meant.boundary - 1
    if j is not None:
        return f"id {j} captures {meant} in {p.name}"
    later = [q for q in later_profiles(p) if ids_for_position(q, meant, L) is not None]
    last = Position.at_boundary(L - 1)
    hint = f"; {later[0].name} reaches it (id {ids_for_position(later[0], meant, L)})" if later else ""
    return (f"{meant} is unreachable in {p.name}; the last position it reaches is {last} "
            f"(id {ids_for_position(p, last, L)}){hint}")


def _patched_hint(rep: Replay) -> str:
    """Where the engine crashes on an embedding id (the loop adds residual=None; not a packer that counts a slot
    missing): a server that runs with it was patched, and how to say so."""
    p = rep.profile
    embed_crash = any(s.fate is Fate.CRASHES for s in rep.slots)
    if not embed_crash or p.patch is not None or not any(q.behaviour.embed.value is EmbedId.CAPTURED
                                                         for q in later_profiles(p)):
        return ""
    return (f"; a server that runs with these ids was patched to capture the embedding: replay it with "
            f"--server {p.released}+embed")


def _crash_fix(rep: Replay) -> str:
    p = rep.profile
    if any(s.fate is Fate.FAILS for s in rep.slots):
        return (f"give ids that each name a distinct boundary {p.name}'s loop reaches: its packer needs every slot "
                "filled (tpsim resolve --server shows the ids)")
    if rep.crashed:
        later = [q for q in later_profiles(p) if q.behaviour.embed.value is EmbedId.CAPTURED]
        up = f", or serve with {later[0].name} or later, which captures the embedding" if later else ""
        return f"drop the id that lands on the embedding (the draft must not expect it){up}"
    return "give ids the engine accepts (tpsim resolve --server shows them)"
