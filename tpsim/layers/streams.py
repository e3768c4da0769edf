"""Two independent pieces of a sublayer run side by side on one GPU: the first on the current
CUDA stream, the second on a side stream forked from it and joined back before either result is
used. The MoE's shared experts (dense GEMMs) run this way next to the routed experts, whose
router, sort, gathers and weighted sum are memory-bound and leave the tensor cores idle.

Same kernels, same inputs, so the same bits: only the order in which the GPU runs them changes.
`use_side_stream(False)` runs both on the current stream, one after the other.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")

_enabled = True
_streams: dict[torch.device, torch.cuda.Stream] = {}


def use_side_stream(on: bool) -> None:
    global _enabled
    _enabled = on


def side_stream_enabled() -> bool:
    return _enabled


def _side(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def side_by_side(first: Callable[[], A], second: Callable[[], B], device: torch.device) -> tuple[A, B]:
    """(first(), second()): on CUDA with the side stream enabled, second() runs on a side stream
    that starts after everything already queued on the current stream, and the current stream
    waits for it before returning. Memory: second()'s inputs are alive until the join (the caller
    holds them), its intermediates live and die on the side stream, and its tensor result is
    recorded on the current stream, so the allocator reuses it only after the reads queued there."""
    if device.type != "cuda" or not _enabled or torch.compiler.is_compiling():
        return first(), second()
    current, side = torch.cuda.current_stream(device), _side(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        b = second()
    a = first()
    current.wait_stream(side)
    if isinstance(b, torch.Tensor):
        b.record_stream(current)
    return a, b
