"""The recorder: stores what the replayed engine stores at each resolved position."""

from __future__ import annotations

import torch

from tpsim.capture.positions import Position
from tpsim.layers.probe import Rows, Sink


class Recorder(Sink):
    """Captures `hidden_states + residual` at the start of the layer a position names (the
    embedding output where residual is None, `final` after the final norm) and concatenates
    them along the last dim in the given order: `[T, len(positions) * hidden]`. Attach it to a
    model's probe (`with model.probe.attach(recorder):`, or `model(ids, recorder=recorder)`).

    `strategy` (tpsim.modes) says how, in a mode that moves the stream:
    - `model-level`: `hidden + residual` between layers, as it stands on this rank;
    - `local`: the same, this rank's real token rows only (padding dropped);
    - `gathered`: all-gathered over the group when the stream is token-sharded;
    - `in-layer`: the residual right after the next consumer's add (`input_layernorm`, or the
      final norm for position L): after a fused all-reduce there.
    """

    def __init__(self, positions: list[Position], strategy: str = "model-level"):
        self.positions, self.strategy = list(positions), strategy
        self.wanted = set(self.positions)
        self.store: dict[Position, torch.Tensor] = {}

    def _keep(self, p: Position, x: torch.Tensor, rows: Rows) -> None:
        self.store[p] = rows.gathered(x, f"capture.{p}") if self.strategy == "gathered" else rows.local(x)

    def boundary(self, b: int, hidden: torch.Tensor, residual: torch.Tensor | None, rows: Rows) -> None:
        p = Position.at_boundary(b)
        if p in self.wanted and self.strategy != "in-layer":
            self._keep(p, hidden if residual is None else hidden + residual, rows)

    def in_layer(self, b: int, residual: torch.Tensor, rows: Rows) -> None:
        p = Position.at_boundary(b)
        if p in self.wanted and self.strategy == "in-layer":
            self._keep(p, residual, rows)

    def final(self, normed: torch.Tensor, rows: Rows) -> None:
        if Position("final") in self.wanted:
            self._keep(Position("final"), normed, rows)

    def parts(self) -> list[torch.Tensor]:
        """This rank's capture of each position, in concatenation order."""
        return [self.store[p] for p in self.positions]

    def concat(self) -> torch.Tensor:
        """`[rows, len(positions) * hidden]`; positions holding different token counts (a
        token-scattered stream captured locally next to a replicated one) cannot be
        concatenated, as in the engine: ValueError naming them."""
        parts = self.parts()
        if len({t.shape[0] for t in parts}) > 1:
            raise ValueError("the captured positions hold different token counts on this rank: " + ", ".join(
                f"{p} {t.shape[0]}" for p, t in zip(self.positions, parts)))
        return torch.cat(parts, dim=-1)
