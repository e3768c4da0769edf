"""`tpsim align`: does the trainer of an EAGLE-3 draft capture the same residual-stream positions,
in the same slot order, as the server that runs it?

Each side is a convention and its ids, given as `--train CONVENTION:IDS --serve CONVENTION:IDS`,
or what a profiled engine reads from the draft's config.json (`--draft-config PATH --server
PROFILE [--train PROFILE]`; tpsim.offline.sides builds those sides). Slot i of a side is the i-th feature
its capture concatenates (list order for specforge-ids/hf-ids, ascending and each position once for the
loop-order engines). Aligned means every slot holds the same position and both sides have the
same number of slots. With `--model` the model also runs once (at `--tp`) and each slot gets the
cosine between the feature training saw and the one the server captures.

Exit 0 aligned, 1 not aligned, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tpsim.capture import Position, PositionKind
from tpsim.profiles.conventions import Convention, check_convention, default_ids, ids_for, named_ids, resolve
from tpsim.draft.config import value_at
from tpsim.base.errors import UsageError, read_text
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.draft.config import KEY, check_keys

LABELS = {  # reason code -> the words the table uses
    "off-by-one": "off by one",
    "embed-never-trained": "embedding slot never seen in training",
    "default-fallback": "default fallback",
    "unreachable": "unreachable layer",
    "order": "different concatenation order",
    "slot-count": "different number of slots",
    "post-norm": "final-norm output vs pre-norm residual",
    "different-layer": "different layer",
}


# --- the two sides ------------------------------------------------------------------------

@dataclass
class Capture:
    """One slot of one side: the id as written and the position it captures (None when the
    convention cannot reach it; `error` is resolve's message)."""

    id: int
    position: Position | None
    error: str | None = None


@dataclass
class Side:
    """What one program captures: its slots in concatenation order and where its ids came from."""

    role: str  # "train" | "serve"
    convention: str
    num_layers: int
    ids: list[int]  # the ids in effect, as written (a default filled in)
    default: bool
    source: str
    slots: list[Capture]
    notes: list[str] = field(default_factory=list)
    fallback: str | None = None  # why a draft-config reader used the default
    ascending: bool = False  # the loop-order engines: ascending, each position once

    @property
    def positions(self) -> list[Position | None]:
        return [c.position for c in self.slots]

    @property
    def resolved(self) -> bool:
        return all(p is not None for p in self.positions)

    @property
    def order(self) -> str:
        return "ascending, each position once" if self.ascending else "list order"

    def ids_text(self) -> str:
        return ("default " if self.default else "") + ",".join(map(str, self.ids))

    def to_dict(self) -> dict:
        return {"role": self.role, "convention": self.convention, "ids": self.ids, "default": self.default,
                "source": self.source, "fallback": self.fallback, "order": self.order,
                "slot_ids": [c.id for c in self.slots], "positions": [_pos(c.position) for c in self.slots],
                "unreachable": [{"id": c.id, "error": c.error} for c in self.slots if c.error],
                "notes": self.notes}


def _pos(p: Position | None) -> str | None:
    return None if p is None else str(p)


def _capture(conv: Convention, ids: list[int], i: int, L: int) -> Capture:
    """Where ids[i] lands in `conv` as part of `ids` (sglang-boundary's +1 depends on the first id)."""
    j = ids[i]
    try:
        if conv is not Convention.SGLANG_BOUNDARY or i == 0:
            return Capture(j, resolve(conv, [j], L).positions[0])
        if ids[0] == 1 and L < 3:  # the first id is itself unreachable; the +1 still applies
            return Capture(j, resolve(Convention.SGLANG, [j], L).positions[0])
        return Capture(j, Position.at_boundary(resolve(conv, [1 if ids[0] == 1 else 0, j], L).internal[1]))
    except UsageError as e:
        return Capture(j, None, str(e))


def make_side(role: str, convention: str | Convention, ids: list[int] | None, L: int, source: str = "given",
              fallback: str | None = None) -> Side:
    """A side from ids (None: the convention's default ids). Unreachable ids stay as slots with an
    error; the loop-order engines sort by id (monotone in position) and keep a repeated id once."""
    conv = check_convention(convention)
    if ids is None:
        return _default_side(role, conv, L, source, fallback)
    if not ids:
        raise UsageError(f"{role} ids are empty; give at least one id or 'default'")
    caps = [_capture(conv, ids, i, L) for i in range(len(ids))]
    if conv.ascending:
        caps = list({c.id: c for c in sorted(caps, key=lambda c: c.id)}.values())
    side = Side(role, conv.value, L, list(ids), False, source, caps, fallback=fallback, ascending=conv.ascending)
    if side.resolved:
        side.notes = resolve(conv, ids, L).notes
    return side


def _default_side(role: str, conv: Convention, L: int, source: str, fallback: str | None) -> Side:
    if conv is Convention.HF:
        raise UsageError(f"hf-ids has no default ids; write --{role} hf-ids:IDS, e.g. "
                         f"--{role} hf-ids:2,{L // 2},{L - 3}")
    ids = default_ids(conv, L)
    try:
        res = resolve(conv, None, L)
    except UsageError as e:
        raise UsageError(f"the {conv.value} default ids {ids} do not fit {L} layers ({e}); give ids instead") from None
    order = sorted(set(ids)) if conv.ascending else ids
    caps = [Capture(j, p) for j, p in zip(order, res.positions)]
    return Side(role, conv.value, L, ids, True, source, caps, res.notes, fallback, conv.ascending)


# --- comparing them -----------------------------------------------------------------------

@dataclass
class Reason:
    """Why a slot (or the whole pair) does not line up: a code from LABELS and the specifics."""

    code: str
    text: str

    def __str__(self) -> str:
        return f"{LABELS[self.code]}: {self.text}"

    def to_dict(self) -> dict:
        return {"code": self.code, "label": LABELS[self.code], "text": self.text}


@dataclass
class Slot:
    """Slot `index` of both captures (None: that side has fewer slots)."""

    index: int
    train: Capture | None
    serve: Capture | None
    reasons: list[Reason] = field(default_factory=list)
    cosine: float | None = None

    @property
    def match(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        t, s = self.train, self.serve
        return {"slot": self.index, "train_id": t and t.id, "train_position": t and _pos(t.position),
                "serve_id": s and s.id, "serve_position": s and _pos(s.position), "match": self.match,
                "reasons": [r.to_dict() for r in self.reasons], "cosine": self.cosine}


@dataclass
class Fix:
    """The server ids that capture the trained positions in the trained order (None: there are
    none, `text` says why)."""

    ids: list[int] | None
    text: str
    slot_ids: dict[Position, int] = field(default_factory=dict)


@dataclass
class ModelRun:
    """align --model: the run that captured every position either side names (cosines per slot)."""

    model: str
    weights: str
    checkpoint_fingerprint: str | None
    tp: int
    dtype: str
    seed: int
    tokens: int
    positions: list[str]
    notes: list[str]
    identical_on_ranks: bool | None = None  # None: nothing to capture, nothing ran

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.identical_on_ranks is None:
            del d["identical_on_ranks"]
        return d


@dataclass
class Report:
    """Both sides slot by slot, the server fix when they differ, and the --model run if any."""

    train: Side
    serve: Side
    slots: list[Slot]
    fix: Fix | None
    notes: list[str] = field(default_factory=list)
    run: ModelRun | None = None

    @property
    def aligned(self) -> bool:
        return all(s.match for s in self.slots)

    @property
    def reasons(self) -> list[Reason]:
        """Each reason code once, with the slots it holds for."""
        seen: dict[str, list[int]] = {}
        for s in self.slots:
            for r in s.reasons:
                if s.index not in seen.setdefault(r.code, []):
                    seen[r.code].append(s.index)
        fell_back = " and ".join(s.role for s in (self.train, self.serve) if s.fallback)
        return [Reason(code, f"{fell_back} ids" if code == "default-fallback" else
                       f"slot{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}") for code, ix in seen.items()]

    def to_dict(self) -> dict:
        return {"aligned": self.aligned, "num_layers": self.train.num_layers,
                "train": self.train.to_dict(), "serve": self.serve.to_dict(),
                "slots": [s.to_dict() for s in self.slots],
                "reasons": [{**r.to_dict(), "slots": [s.index for s in self.slots if r.code in codes(s)]}
                            for r in self.reasons],
                "fix": None if self.fix is None else {"convention": self.serve.convention, "ids": self.fix.ids,
                                                      "text": self.fix.text},
                "notes": self.notes, "run": None if self.run is None else self.run.to_dict()}


def codes(slot: Slot) -> list[str]:
    """The reason codes of one slot."""
    return [r.code for r in slot.reasons]


def align(train: Side, serve: Side, fix: Fix | None = None) -> Report:
    """Compare the two captures slot by slot (`fix`: the server ids that would align them, when the
    caller knows them better than the serve side's convention does)."""
    if train.num_layers != serve.num_layers:
        raise ValueError("both sides must be resolved on the same number of layers")
    n = max(len(train.slots), len(serve.slots))
    slots = [Slot(i, _at(train.slots, i), _at(serve.slots, i)) for i in range(n)]
    fix = fix or serve_fix(train, serve)
    reordered = _reordered(train, serve)
    for s in slots:
        s.reasons = _slot_reasons(s, train, serve, reordered, fix)
    report = Report(train, serve, slots, None if all(s.match for s in slots) else fix)
    report.notes = _fallback_notes(report)
    return report


def _at(items: list, i: int):
    return items[i] if i < len(items) else None


def _reordered(train: Side, serve: Side) -> bool:
    """The same positions (with multiplicity) in a different order."""
    t, s = train.positions, serve.positions
    if t == s or len(t) != len(s) or not (train.resolved and serve.resolved):
        return False
    return sorted(t, key=Position.sort_key) == sorted(s, key=Position.sort_key)


def _slot_reasons(slot: Slot, train: Side, serve: Side, reordered: bool, fix: Fix) -> list[Reason]:
    t, s = slot.train, slot.serve
    out = [Reason("unreachable", f"{side.role} {named_ids(side.convention, c.id, 'id')}: {c.error}")
           for side, c in ((train, t), (serve, s)) if c is not None and c.position is None]
    if t is None or s is None:
        lack = train if t is None else serve
        out.append(Reason("slot-count", f"{lack.role} has no slot {slot.index}: training concatenates "
                                        f"{len(train.slots)} features ({train.convention}), serving "
                                        f"{len(serve.slots)} ({serve.convention})"))
    elif not out and t.position != s.position:
        out = _position_reasons(slot.index, t.position, s.position, train, serve, reordered, fix)
    return out + _fallbacks(train, serve) if out else out


def _position_reasons(i: int, tp: Position, sp: Position, train: Side, serve: Side, reordered: bool,
                      fix: Fix) -> list[Reason]:
    if reordered:
        k = train.positions.index(sp)
        since = (" (the specforge-ids convention is SpecForge's HF-hook backend, removed in 7d1fbf08; current "
                 "SpecForge captures through SGLang, ascending: --draft-config --train specforge replays it)"
                 if train.convention == Convention.SPECFORGE.value else "")
        return [Reason("order", f"serve {sp} is train slot {k}: the same positions, {train.convention} "
                                f"concatenates in {train.order}, {serve.convention} {serve.order}{since}")]
    out = []
    if sp.kind is PositionKind.EMBED and tp.kind is not PositionKind.EMBED:
        out.append(Reason("embed-never-trained", f"serve captures embed in slot {i}, where training saw {tp}"))
    hint = f"; {named_ids(serve.convention, fix.slot_ids[tp], 'id')} captures {tp}" if tp in fix.slot_ids else ""
    if PositionKind.FINAL in (tp.kind, sp.kind):
        out.append(Reason("post-norm", f"train {tp}, serve {sp}: final is the final-norm output, "
                                       f"the rest are pre-norm residual sums{hint}"))
    elif abs(sp.boundary - tp.boundary) == 1:
        where = "after" if sp.boundary > tp.boundary else "before"
        out.append(Reason("off-by-one", f"serve {sp} is one layer {where} train {tp}{hint}"))
    else:
        out.append(Reason("different-layer", f"train {tp}, serve {sp} ({abs(sp.boundary - tp.boundary)} "
                                             f"layers apart){hint}"))
    return out


def _fallbacks(train: Side, serve: Side) -> list[Reason]:
    return [Reason("default-fallback", side.fallback) for side in (train, serve) if side.fallback]


def _fallback_notes(report: Report) -> list[str]:
    outcome = ("the default happens to select the trained positions, so this works by coincidence"
               if report.aligned else "the default does not select the trained positions")
    return [f"{side.role}: {side.fallback}; {outcome}" for side in (report.train, report.serve) if side.fallback]


def serve_fix(train: Side, serve: Side) -> Fix:
    """The ids the server should use: the trained positions, in the trained order."""
    L, conv, want = train.num_layers, serve.convention, train.positions
    if not train.resolved:
        return Fix(None, "training itself names an unreachable id; fix the training ids first")
    try:
        ids = ids_for(conv, want, L)
        got = resolve(conv, ids, L).positions
    except UsageError as e:
        return Fix(None, f"{conv}: no ids capture {positions_text(want)}: {e}")
    if got != want:
        return Fix(None, f"{conv}: no ids capture {positions_text(want)} in this order: {conv} concatenates "
                         f"{serve.order}; retrain with ids in ascending order, each once")
    fixed = make_side("serve", conv, ids, L)
    return Fix(ids, f"serve with {named_ids(conv, ','.join(map(str, ids)))}",
               {c.position: c.id for c in fixed.slots})


def positions_text(positions) -> str:
    return ", ".join("unreachable" if p is None else str(p) for p in positions)


# --- draft config.json --------------------------------------------------------------------

@dataclass
class DraftConfig:
    """The two places a draft config.json can hold the aux layer ids (None: absent or null)."""

    path: Path
    nested: list[int] | None
    top: list[int] | None
    raw: dict = field(default_factory=dict)


def read_draft_config(text: str) -> DraftConfig:
    """Read and type-check --draft-config (a config.json, or a directory holding one)."""
    p = Path(text)
    builtin = BUILTIN_CONFIGS / "drafts" / f"{text.removesuffix('.json')}.json"
    if not p.exists() and "/" not in text and builtin.is_file():  # a built-in draft by name, from a wheel too
        p = builtin
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"  # a FIFO would block the read
        names = ", ".join(sorted(d.stem for d in (BUILTIN_CONFIGS / "drafts").glob("*.json")))
        raise UsageError(f"--draft-config {p} {what}; give the draft model's config.json or its directory, or a "
                         f"built-in draft by name ({names})")
    text = read_text(p, "--draft-config", "JSON", "give the draft's config.json")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--draft-config {p} is not valid JSON ({e.msg} at line {e.lineno}); "
                         "give the draft's config.json") from None
    except RecursionError:
        raise UsageError(f"--draft-config {p} is not a config.json (JSON nested too deeply to read); "
                         "give the draft's config.json") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--draft-config {p} holds a JSON {type(raw).__name__}, not an object; give the draft's config.json")
    _not_a_target_config(p, raw)
    check_keys(raw, f"--draft-config {p}")
    return DraftConfig(p, value_at(raw, ("eagle_config", KEY)), raw.get(KEY), raw)


DRAFT_KEYS = ("eagle_config", KEY, "dflash_config", "draft_vocab_size", "target_hidden_size")
DRAFT_WORDS = ("eagle", "draft", "dflash", "mtp", "nextn")


def _not_a_target_config(p: Path, raw: dict) -> None:
    """A target model's config.json given as the draft's: engines would read it as a draft with no ids (their
    defaults) and triage found nothing; refuse it, naming what gives it away."""
    arch = raw.get("architectures")
    if not isinstance(arch, list) or not arch or any(k in raw for k in DRAFT_KEYS):
        return
    if any(w in str(a).lower() for a in arch for w in DRAFT_WORDS):
        return
    layers = raw.get("num_hidden_layers")
    raise UsageError(f"--draft-config {p} is a target model's config ({', '.join(map(str, arch))}"
                     f"{f', {layers} layers' if isinstance(layers, int) else ''}, none of "
                     f"{', '.join(DRAFT_KEYS)}); give the EAGLE-3 draft's config.json")
