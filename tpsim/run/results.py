"""What the rank jobs return: typed, picklable results that the report reads by field."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.capture.points import Tap


@dataclass(frozen=True)
class SlotVerdict:
    """A capture slot whose ranks differ: what tpsim.offline.diagnosis found it to be."""

    position: str
    placement: str
    correct: bool
    reason: str


@dataclass(frozen=True)
class RankCheck:
    """One rank's capture at one TP degree, compared with its group's rank 0 and with TP=1."""

    tp: int
    rank: int
    group_rank: int
    group: list[int]
    shape: list                      # [rows, width]; a mixed local capture: [[rows per slot], width]
    identical: bool | None           # None: each rank holds its own tokens (dp-attention)
    verdicts: list[SlotVerdict] | None
    finite: bool
    first_nonfinite: tuple[str, int] | None
    rel_err: float | None
    compared: float | None           # share of the capture compared (routing near-ties left out)
    logits_rel_err: float | None
    routing_flip: int | None         # first token whose experts a near-tie flipped against TP=1
    real_flip: tuple[int, int, float] | None  # (MoE layer, token, margin) of a flip no near-tie explains
    all_reduces: int
    all_reduce_bytes: int
    collectives: list[tuple[str, str, int]] = field(default_factory=list)  # (op, caller, bytes)
    modified: list[tuple[str, str | None]] = field(default_factory=list)  # (slot, what it holds now): aliasing
    stage: int | None = None         # the PP stage of this rank (None: no pipeline parallelism)
    slots: list[str] | None = None   # PP, last stage: the positions that reached the draft, in order
    missing: list[str] = field(default_factory=list)  # positions never captured (two-batch overlap's split layers)


@dataclass(frozen=True)
class CaptureResult:
    """One rank's part of a capture: the tensor on group rank 0 (and on every rank when each
    holds its own tokens), after checking that the group's ranks hold the same tensor."""

    identical: bool | None
    capture: torch.Tensor | None
    rank: int
    group_rank: int
    group: list[int]


@dataclass(frozen=True)
class PointsResult:
    """One rank's named points and the collective trace of the forward that produced them."""

    rank: int
    taps: dict[str, Tap]
    collectives: list[tuple[str, str, tuple, str, int]]  # (op, caller, shape, dtype, bytes)
