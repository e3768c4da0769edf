"""Conventions: how each engine or trainer turns the layer ids users write into positions.

| convention           | id j means                                   | valid ids      | order      |
|----------------------|----------------------------------------------|----------------|------------|
| sglang-ids           | capture before layer j+1 (code adds +1)      | -1 .. L-2      | ascending  |
| sglang-boundary-ids  | +1 only when the first id is 1, else before j| internal 0..L-1| ascending  |
| vllm-ids             | before layer j                               | 0 .. L         | ascending  |
| specforge-ids/output-of| out(j)                                     | 0 .. L-1       | list order |
| hf-ids               | index into output_hidden_states (L = final)  | 0 .. L         | list order |
| eagle-ids            | before layer j                               | 0 .. L-1       | ascending  |

The defaults (used when no ids are given) select the same tensors: out(1), out(L//2-1), out(L-4).
Loop-order engines (`if i in layers_to_capture`) capture a repeated id once; list-order
trainers concatenate it twice.

Each convention is an idealised profile (the table's row in the profile enums) that `replay` runs
like any engine's; what makes it a convention is strictness: where an engine would drop or crash,
a convention refuses, saying which ids are valid and which convention reaches the position.

A convention's name is never a profile's: `sglang-ids` is the idealised numbering, `sglang` (as in
`--server sglang@0.5.23`) the engine. The bare names conventions had before (`--convention sglang`,
`--serve sglang:-1,2,30`) are refused with the new spelling (PROFILE_NAMES, check_convention).
"""

from __future__ import annotations

import re
from enum import Enum

from tpsim.base.errors import UsageError
from tpsim.capture.positions import Position, PositionKind
from tpsim.profiles.inverse import ids_for_positions
from tpsim.profiles.cited import Cited, Source, Versions
from tpsim.profiles.profile import (NO_CONFIG, Behaviour, Defaults, Duplicates, EmbedId, Numbering, Order, OutOfRange,
                                    Profile, Site)
from tpsim.profiles.replay import Fate, Replay, Slot, captured_range, replay
from tpsim.profiles.resolution import Resolution, resolution


class Convention(Enum):
    """A numbering of the capture ids with no version (`--convention`): an idealised profile with strict refusals."""

    SGLANG = "sglang-ids"
    SGLANG_BOUNDARY = "sglang-boundary-ids"
    VLLM = "vllm-ids"
    SPECFORGE = "specforge-ids"
    HF = "hf-ids"
    EAGLE = "eagle-ids"

    @classmethod
    def _missing_(cls, value):
        return ALIASES.get(value)

    @property
    def profile(self) -> Profile:
        """The table's row as a profile: what `replay` runs."""
        return _IDEALISED[self][0]

    @property
    def internal_name(self) -> str:
        """The name of the engine's own id list (`resolve --json` shows it)."""
        return _IDEALISED[self][1]

    @property
    def ascending(self) -> bool:
        return self.profile.behaviour.order.value is Order.ASCENDING

    def id_range(self, L: int) -> tuple[int, int] | None:
        """The valid ids on L layers, lowest and highest (None: validity depends on the first id)."""
        shift = self.profile.behaviour.numbering.value.shift
        if shift is None:
            return None
        lo, hi = captured_range(self.profile.behaviour, L)
        return lo - shift, hi - shift


ALIASES = {"output-of": Convention.SPECFORGE}
CONVENTIONS = tuple(n for c in Convention for n in (c.value, *(a for a, t in ALIASES.items() if t is c)))
# The names the conventions had before they got their own: each names a profile (or a registry
# alias of one) too, so where a convention is expected it is refused with the new spelling.
PROFILE_NAMES = {
    "sglang": (Convention.SGLANG, "an engine profile (--server sglang@VERSION)"),
    "sglang-boundary": (Convention.SGLANG_BOUNDARY, "a profile, an alias of sglang (--server sglang-boundary)"),
    "vllm": (Convention.VLLM, "an engine profile (--server vllm@VERSION)"),
    "specforge": (Convention.SPECFORGE, "a trainer profile (--train specforge@VERSION with --draft-config)"),
    "hf": (Convention.HF, "a trainer profile, an alias of transformers (--train hf with --draft-config)"),
    "eagle": (Convention.EAGLE, "a trainer profile (--train eagle with --draft-config)"),
}
_TABLE = Source("tpsim", "tpsim/profiles/conventions.py", "conventions", "the table in the module docstring")


def _idealised(c: Convention, numbering: Numbering, defaults: Defaults, embed: EmbedId, order: Order,
               last_boundary: bool, internal_name: str) -> tuple[Profile, str]:
    def cited(v):
        return Cited(v, _TABLE)
    once = Duplicates.CAPTURED_ONCE if order is Order.ASCENDING else Duplicates.CAPTURED_TWICE
    b = Behaviour(numbering=cited(numbering), defaults=cited(defaults), embed=cited(embed),
                  out_of_range=cited(OutOfRange.REFUSED), order=cited(order), duplicates=cited(once),
                  config=cited(NO_CONFIG), site=cited(Site.BETWEEN_LAYERS), cloned=cited(False),
                  last_boundary=cited(last_boundary))
    return Profile(c.value, (), "convention", Versions(None, None), b), internal_name


_BEFORE, _ASC, _LIST = Defaults.BEFORE_2_MID_LAST3, Order.ASCENDING, Order.LIST
_IDEALISED = {
    Convention.SGLANG: _idealised(Convention.SGLANG, Numbering.OUTPUT_OF_PLUS_ONE, _BEFORE, EmbedId.CAPTURED, _ASC,
                                  False, "layers_to_capture"),
    Convention.SGLANG_BOUNDARY: _idealised(Convention.SGLANG_BOUNDARY, Numbering.PLUS_ONE_IF_FIRST_IS_1, _BEFORE,
                                           EmbedId.CAPTURED, _ASC, False, "layers_to_capture"),
    Convention.VLLM: _idealised(Convention.VLLM, Numbering.BEFORE_LAYER, _BEFORE, EmbedId.CAPTURED, _ASC, True,
                                "aux_hidden_state_layers"),
    Convention.SPECFORGE: _idealised(Convention.SPECFORGE, Numbering.OUTPUT_OF, Defaults.OUTPUT_OF_1_MIDM1_LAST4,
                                     EmbedId.UNREACHABLE, _LIST, True, "aux_hidden_state_layer_ids"),
    Convention.HF: _idealised(Convention.HF, Numbering.HIDDEN_STATES_INDEX, Defaults.NONE, EmbedId.CAPTURED, _LIST,
                              False, "hidden_states_index"),
    Convention.EAGLE: _idealised(Convention.EAGLE, Numbering.BEFORE_LAYER, _BEFORE, EmbedId.CAPTURED, _ASC, False,
                                 "capture_before"),
}
_REACHERS = (Convention.SGLANG, Convention.VLLM, Convention.SPECFORGE, Convention.HF, Convention.EAGLE)


def named_ids(name: str, ids: object, word: str = "ids") -> str:
    """Ids as output names them: `sglang-ids 1,29,57` (a convention's name says what they are) or
    `vllm@0.25.0:llama ids 1,29,57` (a profile's; `word` "id" for one)."""
    return f"{name} {ids}" if name in CONVENTIONS else f"{name} {word} {ids}"


def check_convention(name: str | Convention, option: str | None = None, rest: str = "") -> Convention:
    """The convention `name` names. A profile's name (`sglang`, the old bare spelling) is refused
    with the convention's: `option` (e.g. `--serve`) and `rest` (what followed the name, e.g.
    `:-1,2,30`) spell the fix out in full."""
    if isinstance(name, Convention):
        return name
    try:
        return Convention(name)
    except ValueError:
        pass
    raise UsageError(not_a_convention(name, option, rest))


def not_a_convention(name: str, option: str | None = None, rest: str = "", given: str | None = None) -> str:
    """Why `name` is no convention, as one line, the one place that says so: `option name+rest`
    as written (or `given`), and for a profile's name the convention's spelling, `option new+rest`."""
    given = given or (f"{option} {name}{rest}" if option else "")
    head = f"{given}: " if given else ""
    if name in PROFILE_NAMES:
        conv, what = PROFILE_NAMES[name]
        tail = f": write {option} {conv.value}{rest}" if option else ""
        return f'{head}"{name}" names {what}; the idealised convention is {conv.value}{tail}'
    return f"{head}unknown convention {name!r}; use one of {', '.join(CONVENTIONS)}"


# ASCII digits only: int() also takes "1_0" and non-ASCII digits, near-misses more likely typos than ids
ASCII_ID = re.compile(r"\s*[-+]?[0-9]+\s*")


def parse_convention_ids(text: str, option: str) -> tuple[Convention, list[int] | None]:
    """`CONVENTION:IDS` or `CONVENTION:default` (as `option`, e.g. `--serve`, took it) ->
    (convention, ids; None for `default`). Every `CONVENTION:IDS` option parses here."""
    name, colon, ids = text.partition(":")
    example = f"{option} specforge-ids:1,29,57 or {option} sglang-ids:default"
    if not colon:
        if text.strip() in PROFILE_NAMES:  # `--serve sglang`: the profile, or the convention without ids
            raise UsageError(not_a_convention(text.strip(), option, ":IDS", given=f"{option} {text}"))
        raise UsageError(f"{option} {text!r} has no ':'; write CONVENTION:IDS, e.g. {example}")
    conv = check_convention(name.strip(), option, colon + ids)
    if ids.strip() == "default":
        return conv, None
    parts = ids.split(",")
    if not all(ASCII_ID.fullmatch(x) for x in parts):
        raise UsageError(f"{option} {text!r}: {ids!r} is not a comma-separated list of integers or 'default'; "
                         f"e.g. {example} (negative ids are fine: sglang-ids:-1,2,30)")
    return conv, [int(x) for x in parts]


def refuse_convention_as_profile(text: str, option: str) -> str:
    """`text`, given where a profile (`ENGINE[@VERSION][:MODEL]`) is expected, unchanged; a
    convention's name there (`--server sglang-ids`) is refused, naming the profile it idealises."""
    name = text.partition(":")[0].partition("@")[0].strip()
    try:
        conv = Convention(name)
    except ValueError:
        return text
    profile = next(old for old, (c, _) in PROFILE_NAMES.items() if c is conv)
    fixed = text.replace(name, profile, 1)
    raise UsageError(f'{option} {text}: "{name}" names an idealised convention (--convention {conv.value}), '
                     f"not a profile; the profile it idealises is {profile}: write {option} {fixed}")


def default_ids(convention: str | Convention, L: int) -> list[int]:
    conv = check_convention(convention)
    ids = conv.profile.behaviour.defaults.value.ids(L)
    if ids is None:
        raise UsageError(f"the {conv.value} convention has no default ids; pass --layers (e.g. "
                         f"{','.join(map(str, [2, L // 2, L - 3]))})")
    return ids


def resolve(convention: str | Convention, ids: list[int] | None, L: int) -> Resolution:
    """Ids -> positions in concatenation order, as the named engine or trainer does it; refuses
    what no engine should be given."""
    conv = check_convention(convention)
    if L < 1:
        raise UsageError(f"num_layers={L} must be at least 1")
    if ids is not None and len(ids) == 0:
        raise UsageError("--layers is empty; give at least one id or leave it out for the default")
    if ids is None:
        default_ids(conv, L)  # hf has none: say so in its words
    rep = replay(conv.profile, ids, L)
    bad = next((s for s in rep.slots if s.fate not in (Fate.CAPTURED, Fate.MERGED)), None)
    if bad is not None:
        raise UsageError(_refusal(conv, bad, L))
    # the engine's own list: SGLang stores the +1, a hook on layer j (specforge-ids) stores j
    hook = conv.profile.behaviour.numbering.value is Numbering.OUTPUT_OF
    return resolution(rep, ids, conv.value, list(rep.ids) if hook else [s.internal for s in rep.slots],
                      conv.internal_name, _notes(conv, rep, ids))


def _notes(conv: Convention, rep: Replay, given: list[int] | None) -> list[str]:
    ids, internal, L = rep.ids, [s.internal for s in rep.slots], rep.num_layers
    notes = [f"no ids given: {conv.value} default {ids}"] if given is None else []
    if conv is Convention.SGLANG_BOUNDARY and given is not None:
        notes.append("first id is 1: read as output-of ids, +1 applied" if ids[0] == 1
                     else "first id is not 1: read as before-layer ids, no +1")
    if conv in (Convention.SGLANG, Convention.SGLANG_BOUNDARY) and 0 in internal:
        notes.append("embed: SGLang's DeepSeek/Llama loop computes hidden_states + None there and crashes; "
                     "tpsim captures the embedding output as models that guard residual=None do")
    if conv is Convention.VLLM and L in ids:
        notes.append(f"id {L} = out({L - 1}): vLLM's EagleModelMixin models capture it; its DeepSeek loop "
                     "only from PR #46973 (v0.25.0), before that the slot is silently dropped")
    if conv is Convention.VLLM and 0 in ids:
        notes.append("id 0 = embed: vLLM's EagleModelMixin models (Llama, Qwen, ...) capture it; its DeepSeek "
                     "loop adds residual=None there and crashes (tpsim resolve --server vllm shows it)")
    if conv is Convention.SPECFORGE and len(ids) != 3:
        notes.append("SpecForge itself validates exactly three ids")
    if conv is Convention.HF and L in ids:
        notes.append(f"hf-ids index {L} is the final-norm output, not out({L - 1})")
    if conv.ascending and len(set(ids)) != len(ids):
        notes.append("a repeated id is captured once (the engine loop tests `i in layers`)")
    return notes


def _refusal(conv: Convention, s: Slot, L: int) -> str:
    """Why a convention refuses the id of slot `s` (one the engine would drop, crash on or refuse)."""
    lo, hi = (x - (s.internal - s.id) for x in captured_range(conv.profile.behaviour, L))
    what = "index" if conv is Convention.HF else "layer id"
    stem = f"{what} {s.id} is out of range for {conv.value} with num_layers={L}: valid {lo}..{hi}"
    if conv is Convention.SPECFORGE and s.id < 0:
        return (f"layer id {s.id} is negative: specforge-ids mean out(j), j in 0..{L - 1}; "
                f"the embedding is reachable as {_reachers(Position(PositionKind.EMBED), L)}")
    if conv is Convention.HF:
        return f"{stem} (0 = embed, {L} = final)"
    if conv in (Convention.VLLM, Convention.EAGLE) and 0 <= s.id <= L:
        intended = Position.at_boundary(s.id)
        return f"{stem}; {intended} is reachable as {_reachers(intended, L)}"
    if conv in (Convention.SGLANG, Convention.SGLANG_BOUNDARY) and s.internal == L:
        return (f"{stem}; out({L - 1}) is unreachable in SGLang's capture loop, "
                f"use {_reachers(Position(PositionKind.OUT, L - 1), L)}")
    if conv is Convention.SGLANG_BOUNDARY and s.internal < 0:
        return (f"layer id {s.id} matches no layer in sglang-boundary-ids (no +1 because the first id is not 1; "
                "SGLang would silently skip it); use 0 for the embedding")
    return stem


def _reachers(p: Position, L: int) -> str:
    """Which conventions can capture `p`, with the id each needs."""
    out = [f"{c.value} {ids[0]}" for c in _REACHERS if (ids := ids_for_positions(c.profile, [p], L))]
    return "; ".join(out) if out else "no convention"


def ids_for(convention: str | Convention, positions: list[Position], L: int) -> list[int]:
    """The ids that make `convention` capture `positions` (for loop-order conventions, in any
    order: they capture ascending). Raises UsageError when a position is unreachable."""
    conv = check_convention(convention)
    for p in positions:
        if p.kind is PositionKind.OUT and not 0 <= p.layer < L:
            raise UsageError(f"{p} does not exist in a model of {L} layers")
    ids = ids_for_positions(conv.profile, positions, L)
    if ids is None:
        raise UsageError(_cannot(conv, positions, L))
    return ids


def _cannot(conv: Convention, positions: list[Position], L: int) -> str:
    """Why no ids make `conv` capture `positions`."""
    if conv is Convention.SPECFORGE:
        bad = next(p for p in positions if p.kind is not PositionKind.OUT)
        return f"specforge-ids cannot capture {bad} (ids mean out(j), j >= 0)"
    if conv is Convention.HF:
        return f"hf-ids cannot capture out({L - 1}): index {L} is the final-norm output"
    if any(p.kind is PositionKind.FINAL for p in positions):
        return f"{conv.value} cannot capture final (post-norm); only hf-ids index {L} reaches it"
    if conv is Convention.EAGLE:
        return f"eagle-ids cannot capture out({L - 1}) (ids are 0..{L - 1})"
    if conv is Convention.SGLANG_BOUNDARY and Position(PositionKind.OUT, L - 1) not in positions:
        return (f"sglang-boundary-ids cannot express {','.join(map(str, positions))}: "
                "its +1 heuristic misreads every id list that would")
    return f"{conv.value} cannot capture out({L - 1}): its capture loop ends before the last layer"
