"""What check compares a rank's capture with: the TP=1 reference of its tokens, or (to diagnose a
naive strategy) the right strategy's capture of the same run."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    """The TP=1 run of a rank's tokens: the capture `[T, n * hidden]`, the logits, per MoE layer the
    sorted expert ids `[T, top_k]` and router margins `[T]`, and per out position (by name) the residual
    at its layer's middle (empty for a replica's reference)."""

    capture: torch.Tensor
    logits: torch.Tensor
    routing: dict[int, torch.Tensor]
    margins: dict[int, torch.Tensor]
    residual: dict[str, torch.Tensor]

    def after(self, n: int) -> "Reference":
        """The rows of tokens n..T-1: what a forward after a cached prefix of n tokens should compute."""
        return Reference(self.capture[n:], self.logits[n:], {k: r[n:] for k, r in self.routing.items()},
                         {k: m[n:] for k, m in self.margins.items()}, {k: r[n:] for k, r in self.residual.items()})

    def slots(self, n: int) -> list[torch.Tensor]:
        """The capture split into its n positions' `[T, hidden]` slots."""
        H = self.capture.shape[-1] // n
        return [self.capture[:, i * H:(i + 1) * H] for i in range(n)]


@dataclass
class SameRun:
    """The right strategy's capture of the same run (one tensor per position) and the residuals: what a
    naive capture is diagnosed against (robust where TP=1 and TP=t differ by rounding)."""

    parts: list[torch.Tensor]
    residual: dict[str, torch.Tensor]

    def slots(self, n: int) -> list[torch.Tensor]:
        return self.parts
