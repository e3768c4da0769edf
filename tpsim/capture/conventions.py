"""Conventions: how each engine or trainer turns the layer ids users write into positions.

| convention        | id j means                                   | valid ids      | order      |
|-------------------|----------------------------------------------|----------------|------------|
| sglang            | capture before layer j+1 (code adds +1)      | -1 .. L-2      | ascending  |
| sglang-boundary   | +1 only when the first id is 1, else before j| internal 0..L-1| ascending  |
| vllm              | before layer j                               | 0 .. L         | ascending  |
| specforge/output-of| out(j)                                      | 0 .. L-1       | list order |
| hf                | index into output_hidden_states (L = final)  | 0 .. L         | list order |
| eagle             | before layer j                               | 0 .. L-1       | ascending  |

The defaults (used when no ids are given) select the same tensors: out(1), out(L//2-1), out(L-4).
Loop-order engines (`if i in layers_to_capture`) capture a repeated id once; list-order
trainers concatenate it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpsim.capture.positions import Position, PositionKind
from tpsim.base.errors import UsageError

CONVENTIONS = ("sglang", "sglang-boundary", "vllm", "specforge", "output-of", "hf", "eagle")


@dataclass
class Resolution:
    """What a convention does with some ids on a model of `num_layers` layers."""

    convention: str
    num_layers: int
    ids: list[int] | None  # as written; None = the convention's default
    internal: list[int]  # the engine's own list (e.g. SGLang's layers_to_capture)
    internal_name: str
    positions: list[Position]  # in concatenation order
    notes: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # what the engine's handling breaks (with --server)
    failed: bool = False  # the engine crashes or refuses: nothing is captured

    @property
    def positions_text(self) -> str:
        return ",".join(map(str, self.positions))

    def to_dict(self) -> dict:
        return {"convention": self.convention, "num_layers": self.num_layers, "ids": self.ids,
                "used_default": self.ids is None, self.internal_name: self.internal,
                "positions": [str(p) for p in self.positions], "notes": self.notes, "findings": self.findings,
                "failed": self.failed}


def check_convention(name: str) -> str:
    if name not in CONVENTIONS:
        raise UsageError(f"unknown convention {name!r}; use one of {', '.join(CONVENTIONS)}")
    return "specforge" if name == "output-of" else name


def default_ids(convention: str, L: int) -> list[int]:
    convention = check_convention(convention)
    if convention == "specforge":
        return [1, L // 2 - 1, L - 4]
    if convention == "hf":
        raise UsageError("the hf convention has no default ids; pass --layers (e.g. "
                         f"{','.join(map(str, [2, L // 2, L - 3]))})")
    return [2, L // 2, L - 3]


def _reachers(p: Position, L: int) -> str:
    """Which conventions can capture `p`, with the id each needs."""
    out = []
    for conv in ("sglang", "vllm", "specforge", "hf", "eagle"):
        try:
            out.append(f"{conv} id {ids_for(conv, [p], L)[0]}")
        except UsageError:
            pass
    return "; ".join(out) if out else "no convention"


def _before_layer(convention: str, j: int, L: int, lo: int, hi: int, what: str) -> Position:
    """`j` is a before-layer index (capture at the start of layer j; j = L: after the last layer)."""
    if not lo <= j <= hi:
        intended = Position.at_boundary(j) if 0 <= j <= L else None
        hint = f"; {intended} is reachable as {_reachers(intended, L)}" if intended else ""
        raise UsageError(f"{what} {j} is out of range for {convention} with num_layers={L}: "
                         f"valid {lo}..{hi}{hint}")
    return Position.at_boundary(j)


def resolve(convention: str, ids: list[int] | None, L: int) -> Resolution:
    """Ids → positions in concatenation order, as the named engine or trainer does it."""
    convention = check_convention(convention)
    if L < 1:
        raise UsageError(f"num_layers={L} must be at least 1")
    if ids is not None and len(ids) == 0:
        raise UsageError("--layers is empty; give at least one id or leave it out for the default")
    notes: list[str] = []
    given = ids
    if ids is None:
        ids = default_ids(convention, L)
        notes.append(f"no ids given: {convention} default {ids}")

    if convention in ("sglang", "sglang-boundary"):
        shift = given is not None and (convention == "sglang" or ids[0] == 1)
        if convention == "sglang-boundary" and given is not None:
            notes.append("first id is 1: read as output-of ids, +1 applied" if shift
                         else "first id is not 1: read as before-layer ids, no +1")
        internal = [j + 1 for j in ids] if shift else list(ids)
        lo = -1 if shift else 0
        for j, b in zip(ids, internal):
            if b < 0 or b > L - 1:
                if b == L:
                    raise UsageError(f"layer id {j} is out of range for {convention} with num_layers={L}: "
                                     f"valid {lo}..{L - 1 + lo}; out({L - 1}) is unreachable in SGLang's "
                                     f"capture loop, use {_reachers(Position(PositionKind.OUT, L - 1), L)}")
                if b < 0 and convention == "sglang-boundary":
                    raise UsageError(f"layer id {j} matches no layer in sglang-boundary (no +1 because the "
                                     f"first id is not 1; SGLang would silently skip it); use 0 for the embedding")
                raise UsageError(f"layer id {j} is out of range for {convention} with num_layers={L}: "
                                 f"valid {lo}..{L - 1 + lo}")
        if 0 in internal:
            notes.append("embed: SGLang's DeepSeek/Llama loop computes hidden_states + None there and crashes; "
                         "tpsim captures the embedding output as models that guard residual=None do")
        positions = [Position.at_boundary(b) for b in sorted(set(internal))]
        return _finish(convention, L, given, internal, "layers_to_capture", positions, ids, notes)

    if convention in ("vllm", "eagle"):
        hi = L if convention == "vllm" else L - 1
        for j in ids:
            _before_layer(convention, j, L, 0, hi, "layer id")
        if convention == "vllm" and L in ids:
            notes.append(f"id {L} = out({L - 1}): vLLM's EagleModelMixin models capture it; its DeepSeek loop "
                         "only from PR #46973 (v0.25.0), before that the slot is silently dropped")
        if convention == "vllm" and 0 in ids:
            notes.append("id 0 = embed: vLLM's EagleModelMixin models (Llama, Qwen, ...) capture it; its DeepSeek "
                         "loop adds residual=None there and crashes (tpsim resolve --server vllm shows it)")
        positions = [Position.at_boundary(b) for b in sorted(set(ids))]
        name = "aux_hidden_state_layers" if convention == "vllm" else "capture_before"
        return _finish(convention, L, given, list(ids), name, positions, ids, notes)

    if convention == "specforge":
        for j in ids:
            if j < 0:
                raise UsageError(f"layer id {j} is negative: specforge ids mean out(j), j in 0..{L - 1}; "
                                 f"the embedding is reachable as {_reachers(Position(PositionKind.EMBED), L)}")
            if j > L - 1:
                raise UsageError(f"layer id {j} is out of range for specforge with num_layers={L}: valid 0..{L - 1}")
        if len(ids) != 3:
            notes.append("SpecForge itself validates exactly three ids")
        positions = [Position(PositionKind.OUT, j) for j in ids]
        return _finish(convention, L, given, list(ids), "aux_hidden_state_layer_ids", positions, ids, notes)

    # hf: index into output_hidden_states (L + 1 entries; the last is post-norm)
    for j in ids:
        if not 0 <= j <= L:
            raise UsageError(f"index {j} is out of range for hf with num_layers={L}: valid 0..{L} "
                             f"(0 = embed, {L} = final)")
    if L in ids:
        notes.append(f"hf index {L} is the final-norm output, not out({L - 1})")
    positions = [Position(PositionKind.FINAL) if j == L else Position.at_boundary(j) for j in ids]
    return _finish(convention, L, given, list(ids), "hidden_states_index", positions, ids, notes)


def _finish(convention, L, given, internal, name, positions, ids, notes) -> Resolution:
    if len(set(ids)) != len(ids) and convention in ("sglang", "sglang-boundary", "vllm", "eagle"):
        notes.append("a repeated id is captured once (the engine loop tests `i in layers`)")
    return Resolution(convention, L, None if given is None else list(given), internal, name, positions, notes)


def ids_for(convention: str, positions: list[Position], L: int) -> list[int]:
    """The ids that make `convention` capture `positions` (for loop-order conventions, in any
    order: they capture ascending). Raises UsageError when a position is unreachable."""
    convention = check_convention(convention)
    for p in positions:
        if p.kind is PositionKind.OUT and not 0 <= p.layer < L:
            raise UsageError(f"{p} does not exist in a model of {L} layers")
    if convention == "specforge":
        bad = [p for p in positions if p.kind is not PositionKind.OUT]
        if bad:
            raise UsageError(f"specforge cannot capture {bad[0]} (ids mean out(j), j >= 0)")
        return [p.layer for p in positions]
    if convention == "hf":
        bad = [p for p in positions if p == Position(PositionKind.OUT, L - 1)]
        if bad:
            raise UsageError(f"hf cannot capture out({L - 1}): index {L} is the final-norm output")
        return [L if p.kind is PositionKind.FINAL else p.boundary for p in positions]
    if any(p.kind is PositionKind.FINAL for p in positions):
        raise UsageError(f"{convention} cannot capture final (post-norm); only hf index {L} reaches it")
    b = [p.boundary for p in positions]
    if convention == "vllm":
        return b
    if convention == "eagle":
        if L in b:
            raise UsageError(f"eagle cannot capture out({L - 1}) (ids are 0..{L - 1})")
        return b
    if L in b:
        raise UsageError(f"{convention} cannot capture out({L - 1}): its capture loop ends before the last layer")
    if convention == "sglang":
        return [x - 1 for x in b]
    # sglang-boundary: ids are taken as-is unless the first one is 1, then all get +1.
    want = sorted(set(positions), key=Position.sort_key)
    unshifted = sorted(b, key=lambda x: x == 1)  # a first id of 1 would trigger the +1
    shifted = [x - 1 for x in sorted(b, key=lambda x: x != 2)]  # first id 1 → +1 applied
    for candidate in (unshifted, shifted):
        try:
            if resolve(convention, candidate, L).positions == want:
                return candidate
        except UsageError:
            continue
    raise UsageError(f"sglang-boundary cannot express {','.join(map(str, positions))}: "
                     "its +1 heuristic misreads every id list that would")
