"""Capture strategies: how a capture takes the residual stream in a mode that moves it
(tpsim.capture.recorder stores what each one says; tpsim.modes lists which mode offers which)."""

from __future__ import annotations

from enum import Enum


class Strategy(Enum):
    """A strategy by its CLI name, with what it means for the recorder:

    - `in_layer`: listened to inside the next consumer (after its fused add), not between layers;
    - `in_place`: the listened residual kept by reference while later adds update it (not cloned);
    - `gather_past`: all-gathered over the group when the stream is token-sharded, before every
      boundary past this one (-1: every one; None: never, the rank's own rows);
    - `micro_batches`: each two-batch-overlap micro-batch captured over its own rows and merged."""

    MODEL_LEVEL = "model-level"
    IN_LAYER = ("in-layer", True)
    IN_LAYER_UNCLONED = ("in-layer-uncloned", True, True)
    MICRO_BATCHES = ("micro-batches", False, False, None, True)
    GATHERED = ("gathered", False, False, -1)
    LOCAL = "local"
    # SGLang PR #14280's first revision: `if self.enable_a2a_moe and i > 3`, the 3 hard-coded for
    # DeepSeek-V3's first_k_dense_replace (the merged code tests first_k_dense_replace: GATHERED)
    GATHERED_PAST_HARD_CODED_DENSE = ("gathered-after-3", False, False, 3)

    def __new__(cls, label: str, in_layer: bool = False, in_place: bool = False, gather_past: int | None = None,
                micro_batches: bool = False):
        member = object.__new__(cls)
        member._value_ = label
        member.in_layer, member.in_place, member.gather_past, member.micro_batches = (
            in_layer, in_place, gather_past, micro_batches)
        return member

    def __str__(self) -> str:
        return self.value

    def gathers(self, boundary: int | None) -> bool:
        """Whether the capture before `boundary` (None: after the final norm) is all-gathered."""
        return self.gather_past is not None and (boundary is None or boundary > self.gather_past)
