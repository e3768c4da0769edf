"""The recorder: stores what the replayed engine stores at each resolved position."""

from __future__ import annotations

import torch

from tpsim.capture.positions import Position, PositionKind
from tpsim.layers.probe import Rows, Sink
from tpsim.modes.strategy import Strategy


class Recorder(Sink):
    """Captures `hidden_states + residual` at the start of the layer a position names (the
    embedding output where residual is None, `final` after the final norm) and concatenates
    them along the last dim in the given order: `[T, len(positions) * hidden]`. Attach it to a
    model's probe (`with model.probe.attach(recorder):`, or `model(ids, recorder=recorder)`).

    `strategy` (tpsim.modes) says how, in a mode that moves the stream:
    - `model-level`: `hidden + residual` between layers, as it stands on this rank;
    - `local`: the same, this rank's real token rows only (padding dropped);
    - `gathered`: all-gathered over the group when the stream is token-sharded;
    - `gathered-after-3`: all-gathered only before layers i > 3, local before the others: the
      first revision of SGLang PR #14280 (`if self.enable_a2a_moe and i > 3`, hard-coded for
      DeepSeek-V3's first_k_dense_replace = 3; the review asked what 3 stands for and the merged
      code tests `i > self.first_k_dense_replace`, which `gathered` replays);
    - `in-layer`: the residual right after the next consumer's add (`input_layernorm`, or the
      final norm for position L): after a fused all-reduce there, cloned;
    - `in-layer-uncloned`: the same residual kept by reference while the model's fused
      add-RMSNorms update it in place, as the engine kernels do: every later add lands in the
      captured tensor (SGLang clones it for this reason; Gemma's capture did not, PR #39286).
      The recorder keeps a copy of what it saw at capture time, to tell (`modified`) which slots
      changed afterwards;
    - `micro-batches`: as model-level, and under two-batch overlap also each micro-batch's
      `hidden + residual` at the boundaries of the split layers, the micro-batches' rows
      concatenated in token order (sglang PR #32680, closed unmerged: "each sub-batch captures over
      its own token slice and the results are merged back by token range"). Every other strategy
      listens where SGLang's capture loop does and never hears the split layers: those slots are
      missing (`missing`), the capture narrower.
    """

    def __init__(self, positions: list[Position], strategy: Strategy = Strategy.MODEL_LEVEL):
        self.positions, self.strategy = list(positions), strategy
        self.wanted = set(self.positions)
        self.store: dict[Position, torch.Tensor] = {}
        self.in_place = strategy.in_place
        self.in_layer_site = strategy.in_layer
        self.seen: dict[Position, torch.Tensor] = {}  # uncloned: each slot as it was when captured
        self.last: tuple[Position, torch.Tensor] | None = None  # uncloned: the latest residual heard
        self.pieces: dict[Position, list[tuple[int, torch.Tensor]]] = {}  # micro-batches: (first token, rows)

    def _keep(self, p: Position, x: torch.Tensor, rows: Rows) -> None:
        gather = self.strategy.gathers(p.boundary)
        self.store[p] = rows.gathered(x, f"capture.{p}") if gather else rows.local(x)

    def boundary(self, b: int, hidden: torch.Tensor, residual: torch.Tensor | None, rows: Rows) -> None:
        p = Position.at_boundary(b)
        if p in self.wanted and not self.in_layer_site:
            self._keep(p, hidden if residual is None else hidden + residual, rows)

    def in_layer(self, b: int, residual: torch.Tensor, rows: Rows) -> None:
        p = Position.at_boundary(b)
        if self.in_place:  # the latest add's residual: what every aliased slot holds once the forward is done
            self.last = (Position.at_boundary(b), rows.local(residual))
        if p in self.wanted and self.in_layer_site:
            self._keep(p, residual, rows)
            if self.in_place:
                self.seen[p] = self.store[p].clone()

    def modified(self) -> list[tuple[Position, Position | None]]:
        """(slot, the position it holds now, None when no later state matches) for each slot whose
        tensor changed after it was captured (only an uncloned capture's can)."""
        last = self.last
        return [(p, last[0] if last is not None and last[1].shape == self.store[p].shape
                 and torch.equal(last[1], self.store[p]) else None)
                for p in self.positions if p in self.seen and not torch.equal(self.seen[p], self.store[p])]

    def final(self, normed: torch.Tensor, rows: Rows) -> None:
        if Position(PositionKind.FINAL) in self.wanted:
            self._keep(Position(PositionKind.FINAL), normed, rows)

    def micro_batch(self, b: int, start: int, total: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        p = Position.at_boundary(b)
        if p not in self.wanted or not self.strategy.micro_batches:
            return
        pieces = self.pieces.setdefault(p, [])
        pieces.append((start, hidden + residual))
        if sum(x.shape[0] for _, x in pieces) == total:
            self.store[p] = torch.cat([x for _, x in sorted(pieces, key=lambda piece: piece[0])])

    def missing(self) -> list[Position]:
        """The positions asked for that this forward never captured (two-batch overlap's split layers,
        outside the engine's capture loop)."""
        return [p for p in self.positions if p not in self.store]

    def parts(self) -> list[torch.Tensor]:
        """This rank's capture of each position it captured, in concatenation order."""
        return [self.store[p] for p in self.positions if p in self.store]

    def concat(self) -> torch.Tensor:
        """`[rows, len(positions) * hidden]`; positions holding different token counts (a
        token-scattered stream captured locally next to a replicated one) cannot be
        concatenated, as in the engine: ValueError naming them."""
        parts = self.parts()
        if len({t.shape[0] for t in parts}) > 1:
            raise ValueError("the captured positions hold different token counts on this rank: " + ", ".join(
                f"{p} {t.shape[0]}" for p, t in zip(self.positions, parts)))
        return torch.cat(parts, dim=-1)
