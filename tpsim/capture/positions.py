"""Residual-stream positions: `embed`, `out(k)`, `final` (DESIGN.md vocabulary).

A position's *boundary* is the number of decoder layers run before it: embed = 0,
out(k) = k + 1 (the value `hidden_states + residual` at the start of layer k + 1). `final`
is the output of the final RMSNorm and has no boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tpsim.base.errors import UsageError


@dataclass(frozen=True)
class Position:
    kind: str  # "embed" | "out" | "final"
    layer: int | None = None

    @staticmethod
    def at_boundary(b: int) -> "Position":
        return Position("embed") if b == 0 else Position("out", b - 1)

    @property
    def boundary(self) -> int | None:
        return {"embed": 0, "out": (self.layer or 0) + 1}.get(self.kind)

    def sort_key(self) -> float:
        return float("inf") if self.kind == "final" else self.boundary

    def __str__(self) -> str:
        return f"out({self.layer})" if self.kind == "out" else self.kind

    @staticmethod
    def parse(text: str, num_layers: int) -> "Position":
        text = text.strip()
        if text in ("embed", "final"):
            return Position(text)
        m = re.fullmatch(r"out\((\d+)\)", text)
        if not m:
            raise UsageError(f"position {text!r} is not one of embed, out(k), final")
        k = int(m.group(1))
        if k >= num_layers:
            raise UsageError(f"position out({k}) does not exist: layers are 0..{num_layers - 1}")
        return Position("out", k)
