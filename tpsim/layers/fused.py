"""The memory-bound pieces of a layer as pure tensor functions, eager or compiled.

Eager, each of these is several kernels that each read and write the whole `[T, width]` tensor
(casts to float32, the add, the norm, the weight; the rotation and the q/k concatenations; silu
and the product; the weighted sum over a token's experts); `torch.compile` fuses each into one or two kernels. The eager functions are the
reference and the CPU path; `use_compiled(True)` (`--compile`, on by default on CUDA) makes the
layers call the compiled ones. Taps and captures stay outside these functions, so a compiled
region never sees a recorder (no guard on it, no recompile per forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual) * weight, x + residual): the add in float32, the sum cast back to x's dtype."""
    dtype = x.dtype
    total = x.float() + residual
    return F.rms_norm(total, (total.shape[-1],), eps=eps).to(dtype) * weight, total.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """`[..., 2n]` (gate | up) → silu(gate) * up `[..., n]`."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rotation (adjacent pairs) of `x [T, heads, d]` in float32 by `cos`, `sin` `[T, 1, d/2]`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


def assemble_qk(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor):
    """MLA's query and key heads: `[T, h, nope | rope]` each, the one rotated k_pe head `[T, 1, rope]`
    shared by every head."""
    h, rope = k_nope.shape[1], k_pe.shape[-1]
    return torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, k_pe.expand(k_nope.shape[0], h, rope)], dim=-1)


def weighted_sum(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs `y [T, k, hidden]` weighted by `weights [T, k]` (rounded once to
    y's dtype) and summed in float32, cast back to y's dtype."""
    return (y.float() * weights.to(y.dtype).float().unsqueeze(-1)).sum(1).to(y.dtype)


@dataclass(frozen=True)
class Kernels:
    add_rms_norm: Callable
    rms_norm: Callable
    silu_mul: Callable
    rope_pairs: Callable
    assemble_qk: Callable
    weighted_sum: Callable


_FUNCTIONS = (add_rms_norm, rms_norm, silu_mul, rope_pairs, assemble_qk, weighted_sum)
EAGER = Kernels(*_FUNCTIONS)
_compiled: Kernels | None = None
_active = EAGER


def use_compiled(on: bool) -> None:
    """Make the layers call the compiled kernels (compiled on first use) or the eager ones."""
    global _active, _compiled
    if on and _compiled is None:
        _compiled = Kernels(*(torch.compile(f, dynamic=None) for f in _FUNCTIONS))
    _active = _compiled if on else EAGER


def kernels() -> Kernels:
    return _active
