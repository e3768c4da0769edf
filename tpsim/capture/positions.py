"""Residual-stream positions: `embed`, `out(k)`, `final` (DESIGN.md vocabulary).

A position's *boundary* is the number of decoder layers run before it: embed = 0,
out(k) = k + 1 (the value `hidden_states + residual` at the start of layer k + 1). `final`
is the output of the final RMSNorm and has no boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from tpsim.base.errors import UsageError


class PositionKind(Enum):
    """Where in the model a capture reads: the embedding output, a layer's output, or the final norm's."""

    EMBED = "embed"
    OUT = "out"
    FINAL = "final"


@dataclass(frozen=True)
class Position:
    """One captured tensor's place: `out` needs its layer, `embed` and `final` take none."""

    kind: PositionKind
    layer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, PositionKind):  # a string here would compare unequal everywhere, silently
            raise TypeError(f"Position kind must be a PositionKind, not {self.kind!r}")

    @staticmethod
    def at_boundary(b: int) -> "Position":
        return Position(PositionKind.EMBED) if b == 0 else Position(PositionKind.OUT, b - 1)

    @property
    def boundary(self) -> int | None:
        if self.kind is PositionKind.FINAL:
            return None
        return 0 if self.kind is PositionKind.EMBED else (self.layer or 0) + 1

    def sort_key(self) -> float:
        return float("inf") if self.kind is PositionKind.FINAL else self.boundary

    def __str__(self) -> str:
        return f"out({self.layer})" if self.kind is PositionKind.OUT else self.kind.value

    @staticmethod
    def parse(text: str, num_layers: int) -> "Position":
        text = text.strip()
        if text in ("embed", "final"):
            return Position(PositionKind(text))
        m = re.fullmatch(r"out\((\d+)\)", text)
        if not m:
            raise UsageError(f"position {text!r} is not one of embed, out(k), final")
        k = int(m.group(1))
        if k >= num_layers:
            raise UsageError(f"position out({k}) does not exist: layers are 0..{num_layers - 1}")
        return Position(PositionKind.OUT, k)
