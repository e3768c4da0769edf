"""What a profiled engine does with ids on a model of L layers: which slots it captures, which it
silently drops, and whether it crashes or refuses, as the engine's own loop would.

A replay never refuses on the engine's behalf: an id the engine's loop never matches is dropped,
an embedding id in a loop that adds `residual=None` crashes with the engine's error. The idealised
conventions (tpsim.profiles.conventions) replay here too; their strictness is theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpsim.draft.config import check_id_count
from tpsim.capture.positions import Position, PositionKind
from tpsim.base.errors import UsageError
from tpsim.profiles.profile import Behaviour, Defaults, EmbedId, Fate, Numbering, Order, Profile, Wiring

CRASH_TEXT = "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'"
# a packing engine that captured nothing returns the hidden states alone; the caller's two-way unpack fails
UNPACK_TEXT = "ValueError: too many values to unpack (expected 2)"


@dataclass(frozen=True)
class Slot:
    """One id as written: the number the engine's loop tests (`internal`), and what becomes of it."""

    index: int
    id: int
    internal: int
    position: Position | None  # what it captures (None unless CAPTURED or MERGED)
    fate: Fate


@dataclass
class Replay:
    profile: Profile
    num_layers: int
    ids: list[int]  # in effect (the default filled in)
    used_default: bool
    slots: list[Slot]
    positions: list[Position]  # the capture, in concatenation order
    failure: str | None = None  # the engine's crash or refusal, in its words
    notes: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> list[Slot]:
        return [s for s in self.slots if s.fate is Fate.DROPPED]

    @property
    def crashed(self) -> bool:
        """The forward fails: an id crashes it, or the packer counts a slot missing."""
        return any(s.fate in (Fate.CRASHES, Fate.FAILS) for s in self.slots)

    @property
    def refused(self) -> bool:
        return any(s.fate is Fate.REFUSED for s in self.slots)

    def width_text(self, hidden: int) -> str:
        n = len(self.positions)
        return f"{n} x {hidden} = {n * hidden} (the draft's fc expects {len(self.slots)} x {hidden} = " \
               f"{len(self.slots) * hidden})"


def internal_ids(numbering: Numbering, ids: list[int], L: int) -> list[int]:
    """The numbers the engine's loop compares with its layer boundary (hf: the tuple index)."""
    if numbering is Numbering.PLUS_ONE_IF_FIRST_IS_1:
        return [j + 1 for j in ids] if ids and ids[0] == 1 else list(ids)
    if numbering is Numbering.PLUS_ONE_UNLESS_MAX_IS_L:
        return list(ids) if ids and max(ids) == L else [j + 1 for j in ids]
    return [j + numbering.shift for j in ids]  # output-of: a hook on layer j sees what layer j+1 receives


def captured_range(b: Behaviour, L: int) -> tuple[int, int]:
    """The internal ids the capture loop captures (`slot`'s CAPTURED), lowest and highest."""
    hf = b.numbering.value is Numbering.HIDDEN_STATES_INDEX
    return 0 if b.embed.value is EmbedId.CAPTURED else 1, L if b.last_boundary.value or hf else L - 1


def replay(profile: Profile, ids: list[int] | None, L: int) -> Replay:
    """Run the profile's id handling on `ids` (None: its default) for a model of L layers."""
    check_id_count(ids)
    b = profile.behaviour
    notes = []
    if ids is not None and b.config.value.hard_coded:
        notes.append(f"{profile.engine} hard-codes its layers: ids {ids} are not read")
        ids = None
    used_default = ids is None
    if ids is None:
        ids = b.defaults.value.ids(L)
        if ids is None:
            raise UsageError(f"{profile.name} has no default ids ({b.defaults.source}); give the ids")
        internal = list(ids) if b.defaults.value is Defaults.BEFORE_2_MID_LAST3 else \
            internal_ids(b.numbering.value, ids, L)
        notes.append(f"no ids given: {profile.engine} default {ids} ({b.defaults.value.value})")
    else:
        internal = internal_ids(b.numbering.value, ids, L)
    slots = _order(profile, [slot(profile, k, j, i, L) for k, (j, i) in enumerate(zip(ids, internal))])
    captured = [s for s in slots if s.fate is Fate.CAPTURED]
    if b.order.value is Order.ASCENDING:
        captured = sorted(captured, key=lambda s: s.internal)
    return Replay(profile, L, list(ids), used_default, slots, [s.position for s in captured],
                  _failure(profile, slots, L), notes)


def slot(profile: Profile, k: int, j: int, i: int, L: int) -> Slot:
    """Slot k: id j, which the loop tests as i (before any repeat is merged)."""
    b = profile.behaviour
    hf = b.numbering.value is Numbering.HIDDEN_STATES_INDEX
    if not b.captures:
        return Slot(k, j, i, None, Fate.IGNORED if b.wiring.value is Wiring.IGNORED else Fate.REFUSED)
    if i == 0:
        fate = b.embed.value.fate
        return Slot(k, j, i, Position(PositionKind.EMBED) if fate is Fate.CAPTURED else None, fate)
    if 0 < i < L or (i == L and (b.last_boundary.value or hf)):
        return Slot(k, j, i, Position(PositionKind.FINAL) if hf and i == L else Position.at_boundary(i), Fate.CAPTURED)
    return Slot(k, j, i, None, b.out_of_range.value.fate)


def _order(profile: Profile, slots: list[Slot]) -> list[Slot]:
    """A repeated id: the loop-order engines capture it once; list-order trainers twice or refuse."""
    dup = profile.behaviour.duplicates.value
    seen: set[int] = set()
    out = []
    for s in slots:
        if s.internal in seen and s.fate is Fate.CAPTURED:
            s = Slot(s.index, s.id, s.internal, s.position, dup.fate)
        seen.add(s.internal)
        out.append(s)
    return out


def _failure(profile: Profile, slots: list[Slot], L: int) -> str | None:
    b, who = profile.behaviour, profile.engine
    if not b.captures:  # the model class, not the ids: the engine's words, where it has any
        return (f"{b.wiring.error} ({b.wiring.source})" if b.wiring.error else None) if slots else None
    crash = next((s for s in slots if s.fate is Fate.CRASHES), None)
    if crash is not None:
        return (f"{CRASH_TEXT}: {who} id {crash.id} tests layer 0, where the loop adds hidden_states + "
                f"residual and residual is still None ({b.embed.source})")
    short = next((s for s in slots if s.fate is Fate.FAILS), None)
    if short is not None:
        return _packer_failure(profile, slots, short, L)
    refused = next((s for s in slots if s.fate is Fate.REFUSED), None)
    if refused is not None:
        what = ("a repeated id" if any(s.internal == refused.internal for s in slots if s is not refused)
                else f"id {refused.id} (out of range for {L} layers)")
        return f"{who} refuses {what} ({b.out_of_range.source})"
    return None


def _packer_failure(profile: Profile, slots: list[Slot], short: Slot, L: int) -> str:
    """The engine's words when its packer holds fewer captures than ids (`short`: the first slot missing)."""
    b = profile.behaviour
    repeat = any(s.internal == short.internal for s in slots if s.index < short.index)
    cited = b.duplicates if repeat else b.out_of_range
    what = f"id {short.id} is a repeat" if repeat else f"id {short.id} is never reached on {L} layers"
    got, n = sum(s.fate is Fate.CAPTURED for s in slots), len(slots)
    if got == 0:
        return (f"{UNPACK_TEXT}: {profile.name} captured none of its {n} slots ({what}), so the model returns the "
                f"hidden states alone and the caller's `hidden_states, aux_hidden_states = hidden_states` fails "
                f"(inferred from the code; {cited.source})")
    return f"{cited.error.format(i=got, n=n)}: {profile.name} packs {n} slots and {what} ({cited.source})"
