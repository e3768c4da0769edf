"""`align` with profiles: a side is what a profiled engine captures, read from the draft config
as that engine reads it, and the server fix is checked by replaying it through the profile."""

from __future__ import annotations

from tpsim.offline.align import Capture, DraftConfig, Fix, Report, Side, align
from tpsim.capture.positions import Position, PositionKind
from tpsim.base.errors import UsageError
from tpsim.profiles.draft import ConfigIds, read_ids
from tpsim.profiles.profile import Order, Profile
from tpsim.profiles.inverse import captures_exactly, ids_for_position
from tpsim.profiles.replay import Fate, Replay, replay


def side_from_replay(role: str, rep: Replay, source: str, fallback: str | None = None) -> Side:
    """The slots of a replay as align sees them: the captured ones in concatenation order, then
    each dropped or failing id as an unreachable slot."""
    p = rep.profile
    by_internal = {s.internal: s for s in rep.slots if s.fate is Fate.CAPTURED}
    ascending = p.behaviour.order.value is Order.ASCENDING
    caps = ([Capture(by_internal[pos.boundary if pos.kind is not PositionKind.FINAL else rep.num_layers].id, pos)
             for pos in rep.positions] if ascending else
            [Capture(s.id, s.position) for s in rep.slots if s.fate is Fate.CAPTURED])
    caps += [Capture(s.id, None, _why(rep, s)) for s in rep.slots if s.fate not in (Fate.CAPTURED, Fate.MERGED)]
    return Side(role, p.name, rep.num_layers, rep.ids, rep.used_default, source, caps, list(rep.notes),
                fallback, ascending)


def _why(rep: Replay, s) -> str:
    if s.fate is Fate.DROPPED:
        return (f"internal id {s.internal} is never matched by {rep.profile.engine}'s capture loop "
                f"(layers 0..{rep.num_layers - 1}): the slot is silently missing")
    return rep.failure or s.fate.value


def side_from_config(role: str, profile: Profile, draft: DraftConfig, L: int) -> tuple[Side, ConfigIds]:
    """What `profile` captures from this draft config on L layers."""
    got = read_ids(profile, draft.raw)
    if got.failure and got.off:
        return Side(role, profile.name, L, [], False, f"{draft.path}: capture off", [], [got.failure]), got
    if got.failure:
        raise UsageError(f"--draft-config {draft.path}: {got.failure}")
    rep = replay(profile, got.ids, L)
    source = f"{draft.path}: {got.where}"
    fallback = None
    if got.fallback:
        over = profile.behaviour.config.value.overridden_by
        fallback = (f"{got.fallback}; {profile.engine} uses its default {rep.ids}"
                    + (f" (unless {over} was set)" if over else ""))
    return side_from_replay(role, rep, source, fallback), got


def profile_fix(train: Side, serve: Profile, L: int) -> Fix:
    """The ids `serve` needs to capture the trained positions in the trained order, checked by
    replaying them."""
    want = train.positions
    if not train.resolved or not want:
        return Fix(None, "training itself names an unreachable id; fix the training ids first")
    single = [ids_for_position(serve, p, L) for p in want]
    if any(j is None for j in single):
        bad = want[single.index(None)]
        return Fix(None, f"{serve.name} cannot capture {bad}")
    ids = ids_capturing(serve, want, L)
    if ids is not None:
        return Fix(ids, f"serve with ids {','.join(map(str, ids))} ({serve.name})", {p: j for p, j in zip(want, ids)})
    return Fix(None, f"{serve.name} captures in ascending order, each position once: no ids give "
                     f"{', '.join(map(str, want))} in this order; retrain with ids in ascending order")


def ids_capturing(profile: Profile, want: list[Position], L: int, prefer: list[int] | None = None) -> list[int] | None:
    """Ids that make `profile` capture exactly `want`, in that order (None: none do); `prefer`
    (e.g. the ids a config already holds) first, when they do."""
    single = [ids_for_position(profile, p, L) for p in want]
    for ids in ([prefer] if prefer else []) + [single, [p.boundary - 1 for p in want if p.kind is not PositionKind.FINAL]]:
        if None not in ids and len(ids) == len(want) and captures_exactly(profile, ids, L, want):
            return ids
    return None


def align_profiles(train: Side, serve: Side, serve_profile: Profile) -> Report:
    return align(train, serve, profile_fix(train, serve_profile, train.num_layers))
