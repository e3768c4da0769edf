"""The memory-bound pieces of a layer as pure tensor functions, eager or compiled.

Eager, each of these is several kernels that each read and write the whole `[T, width]` tensor
(casts to float32, the add, the norm, the weight; the rotation and the q/k concatenations; silu
and the product; the weighted sum over a token's experts); `torch.compile` fuses each into one or two kernels. The eager functions are the
reference and the CPU path; `use_compiled(True)` (`--compile`, on by default on CUDA) makes the
layers call the compiled ones in forwards of at least MIN_TOKENS tokens (`select`, at each forward's start). Taps and captures stay outside these functions, so a compiled
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
    y's dtype) and summed in float32, cast back to y's dtype: one batched [1, k] x [k, hidden] product
    per token (eager: a float32 copy of y would cost more than the product)."""
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1)


def weighted_sum_fused(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same sum written elementwise, which torch.compile fuses into one pass over y (a compiled
    bmm stays a batched GEMV)."""
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
_TO_COMPILE = (add_rms_norm, rms_norm, silu_mul, rope_pairs, assemble_qk, weighted_sum_fused)
EAGER = Kernels(*_FUNCTIONS)
# Below this many tokens a forward on the H200 is launch-bound, and the compiled kernels' guards cost
# more host time than their fusion saves GPU time. Measured (benchmarks/results/forward-cuda.json,
# V2-Lite bf16, same rounds): 512 tokens 64.9 ms compiled vs 52.3 eager; 4096 tokens 63.2 vs 80.6;
# 8192 tokens 116.1 vs 153.4 (one earlier run had 4096 at 117.8 vs 93.9, the host busier)
MIN_TOKENS = 4096
_compiled: Kernels | None = None
_wanted, _min_tokens = False, MIN_TOKENS
_active = EAGER


def use_compiled(on: bool, min_tokens: int = MIN_TOKENS) -> None:
    """Ask for the compiled kernels (compiled on first use) in forwards of at least `min_tokens` tokens
    (`select`), or for the eager ones everywhere."""
    global _active, _compiled, _wanted, _min_tokens
    if on and _compiled is None:
        _compiled = Kernels(*(torch.compile(f, dynamic=None) for f in _TO_COMPILE))
    _wanted, _min_tokens = on, min_tokens
    _active = EAGER


def select(tokens: int) -> None:
    """At the start of a forward of `tokens` tokens: the kernels its layers call."""
    global _active
    _active = _compiled if _wanted and tokens >= _min_tokens else EAGER


def kernels() -> Kernels:
    return _active
