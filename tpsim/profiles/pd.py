"""Prefill/decode (PD) disaggregation with an EAGLE-3 draft: what the prefill server hands the decode
server for the draft's first decode step, and how wide the buffer both sides allocate for it is
(SGLang's MetadataBuffers). The widths decide whether the hand-off runs: a hidden state wider or
narrower than its buffer fails the copy into it (a shape error), before anything is sent."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Widths:
    """The hidden sizes the hand-off involves: the target's, the draft's, and how many aux states
    the target captures for the draft (3 for EAGLE-3)."""

    target: int
    draft: int
    num_aux: int = 3


class PdTransfer(Enum):
    """What the prefill server transfers per request, into a buffer of which width."""

    TARGET_AUX = ("the target's logits_output hidden states (under EAGLE-3 the aux states, num_aux x H_target) "
                  "into an H_target-wide buffer")
    DRAFT_IN_TARGET_WIDTH = "the draft's hidden state (H_draft) into an H_target-wide buffer"
    DRAFT = "the draft's hidden state into an H_draft-wide buffer"

    def sent(self, w: Widths) -> int:
        """Values sent per request."""
        return w.num_aux * w.target if self is PdTransfer.TARGET_AUX else w.draft

    def buffer(self, w: Widths) -> int:
        """The width of the buffer each side allocates per request."""
        return w.draft if self is PdTransfer.DRAFT else w.target

    @property
    def what(self) -> str:
        """The tensor sent, in words."""
        return "the target's aux hidden states" if self is PdTransfer.TARGET_AUX else "the draft's hidden state"

    def sent_text(self, w: Widths) -> str:
        """`3 x 64 = 192`, or `64`: how the sent width is made up."""
        if self is PdTransfer.TARGET_AUX:
            return f"{w.num_aux} x {w.target} = {self.sent(w)}"
        return str(self.sent(w))

    def fits(self, w: Widths) -> bool:
        return self.sent(w) == self.buffer(w)
