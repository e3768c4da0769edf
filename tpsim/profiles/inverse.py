"""Positions -> ids, for a profile or a convention alike: the ids whose replay captures them."""

from __future__ import annotations

from tpsim.capture.positions import Position, PositionKind
from tpsim.profiles.profile import Numbering, Order, Profile
from tpsim.profiles.replay import Fate, internal_ids, replay, slot


def ids_for_position(profile: Profile, p: Position, L: int) -> int | None:
    """The id that makes this profile capture `p` when written alone (None: no id does)."""
    b = profile.behaviour
    n = b.numbering.value
    if b.config.value.hard_coded:
        return None
    if p.kind is PositionKind.FINAL:
        return L if n is Numbering.HIDDEN_STATES_INDEX else None
    # every numbering tests an id j as j or j + 1: only t - 1 and t can reach boundary t (looping over
    # every id instead made `resolve --num-layers 10**9` run for ever; found by test_fuzz_no_traceback)
    for j in (x for x in (p.boundary - 1, p.boundary) if -1 <= x <= L + 1):
        if n is Numbering.PLUS_ONE_IF_FIRST_IS_1 and j == 1:
            continue  # alone, 1 turns on the +1; other ids stay as written
        s = slot(profile, 0, j, internal_ids(n, [j], L)[0], L)
        if s.fate is Fate.CAPTURED and s.position == p and s.internal == p.boundary:
            return j
    if n is Numbering.PLUS_ONE_IF_FIRST_IS_1 and p.boundary == 2:
        return 1
    return None


def ids_for_positions(profile: Profile, positions: list[Position], L: int) -> list[int] | None:
    """Ids that make this profile capture `positions` (a loop-order profile: in any order, it
    captures them ascending); None: no ids do."""
    if profile.behaviour.numbering.value is not Numbering.PLUS_ONE_IF_FIRST_IS_1:
        single = [ids_for_position(profile, p, L) for p in positions]
        return None if None in single else single
    if not positions or any(p.kind is PositionKind.FINAL for p in positions):
        return None
    # the +1 depends on the first id: as boundaries with no 1 first, or all shifted with 1 (= out(1)) first
    b = [p.boundary for p in positions]
    unshifted = sorted(b, key=lambda x: x == 1)
    shifted = [x - 1 for x in sorted(b, key=lambda x: x != 2)]
    want = sorted(set(positions), key=Position.sort_key) \
        if profile.behaviour.order.value is Order.ASCENDING else list(positions)
    return next((ids for ids in (unshifted, shifted) if captures_exactly(profile, ids, L, want)), None)


def captures_exactly(profile: Profile, ids: list[int], L: int, want: list[Position]) -> bool:
    """The replay of `ids` captures `want`, in that order, and nothing fails or is dropped."""
    rep = replay(profile, ids, L)
    return rep.failure is None and not rep.dropped and rep.positions == want
