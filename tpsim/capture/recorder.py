"""The recorder: stores what the replayed engine stores at each resolved position."""

from __future__ import annotations

import torch

from tpsim.capture.positions import Position


class Recorder:
    """Captures `hidden_states + residual` at the start of the layer a position names (the
    embedding output where residual is None, `final` after the final norm) and concatenates
    them along the last dim in the given order: `[T, len(positions) * hidden]`."""

    def __init__(self, positions: list[Position]):
        self.positions = list(positions)
        self.wanted = set(self.positions)
        self.store: dict[Position, torch.Tensor] = {}

    def at_boundary(self, b: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        p = Position.at_boundary(b)
        if p in self.wanted:
            self.store[p] = hidden if residual is None else hidden + residual

    def at_final(self, normed: torch.Tensor) -> None:
        if Position("final") in self.wanted:
            self.store[Position("final")] = normed

    def concat(self) -> torch.Tensor:
        return torch.cat([self.store[p] for p in self.positions], dim=-1)
