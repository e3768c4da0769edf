"""Triton kernels for two memory-bound steps that inductor's generated code does slowly, each a
`torch.library.triton_op` so that a compiled region traces it whole. Imported only where Triton
is; `tpsim.layers.fused` holds the pure-tensor reference of each and chooses.

- `rope_assemble_qk`: inductor writes MLA's q and k heads as one flat loop with 14 masked loads
  per element, recomputing the shared k_pe rotation for every head.
- `greedy_top`: the router's softmax, top-(k+1) and gather were four kernels (torch.topk alone a
  radix select and a bitonic sort), for 64 scores a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


def fits_rope_assemble(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether `rope_assemble_qk` takes these: CUDA, some tokens, unit inner strides, power-of-two nope
    and rope dims."""
    nope, rope = q.shape[-1] - k_pe.shape[-1], k_pe.shape[-1]
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in (nope, rope))
    return (q.is_cuda and pow2 and q.shape[0] > 0 and all(t.stride(-1) == 1 for t in (q, k_pe, kv))
            and kv.shape[-1] >= nope)


@triton.jit
def _rope_assemble_qk(q_ptr, kpe_ptr, kv_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T,
                      sq_t, sq_h, skpe_t, skv_t, skv_h,
                      H: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
                      BT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    rows = (t < T)[:, None]
    d, r, j = tl.arange(0, NOPE)[None, :], tl.arange(0, ROPE)[None, :], tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + t[:, None] * HALF + j, mask=rows)
    sin = tl.load(sin_ptr + t[:, None] * HALF + j, mask=rows)
    k_pe = tl.load(kpe_ptr + t[:, None] * skpe_t + r, mask=rows)
    out = t[:, None] * (H * (NOPE + ROPE))
    for h in range(H):
        q = q_ptr + t[:, None] * sq_t + h * sq_h
        o = out + h * (NOPE + ROPE)
        tl.store(qo_ptr + o + d, tl.load(q + d, mask=rows), mask=rows)
        pe = tl.load(q + NOPE + r, mask=rows)
        even, odd = tl.split(tl.reshape(pe.to(tl.float32), (BT, HALF, 2)))
        rotated = tl.interleave(even * cos - odd * sin, even * sin + odd * cos)
        tl.store(qo_ptr + o + NOPE + r, rotated.to(pe.dtype), mask=rows)
        tl.store(ko_ptr + o + d, tl.load(kv_ptr + t[:, None] * skv_t + h * skv_h + d, mask=rows), mask=rows)
        tl.store(ko_ptr + o + NOPE + r, k_pe, mask=rows)


@triton_op("tpsim::rope_assemble_qk", mutates_args={})
def rope_assemble_qk(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `fused.rope_assemble_qk` (`fits_rope_assemble` says when it applies), in one pass."""
    T, H, width = q.shape
    rope = k_pe.shape[-1]
    q_out, k_out = q.new_empty((T, H, width)), q.new_empty((T, H, width))
    block = 16
    wrap_triton(_rope_assemble_qk)[(triton.cdiv(T, block),)](
        q, k_pe, kv, cos.contiguous(), sin.contiguous(), q_out, k_out, T,
        q.stride(0), q.stride(1), k_pe.stride(0), kv.stride(0), kv.stride(1),
        H=H, NOPE=width - rope, ROPE=rope, HALF=rope // 2, BT=block, num_warps=4)
    return q_out, k_out


@triton.jit
def _greedy_top(logits_ptr, w_ptr, ids_ptr, margin_ptr, T,
                E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, SOFTMAX: tl.constexpr, BT: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    rows = t < T
    e = tl.arange(0, BE)
    real = (e < E)[None, :]
    x = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=rows[:, None] & real, other=float("-inf"))
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = p / tl.sum(p, axis=1)[:, None]
    else:
        s = tl.sigmoid(x)
    s = tl.where(real, s, float("-inf"))
    last = tl.zeros((BT,), tl.float32)
    for i in tl.static_range(K):
        last = tl.max(s, axis=1)
        pick = tl.argmax(s, axis=1, tie_break_left=True)
        tl.store(w_ptr + t * K + i, last, mask=rows)
        tl.store(ids_ptr + t * K + i, pick.to(tl.int64), mask=rows)
        s = tl.where(e[None, :] == pick[:, None], float("-inf"), s)
    gap = last - tl.max(s, axis=1)
    tl.store(margin_ptr + t, tl.where((gap == gap) & (gap != float("inf")), gap, float("inf")), mask=rows)


@triton_op("tpsim::greedy_top", mutates_args={})
def greedy_top(logits: torch.Tensor, k: int, softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `fused.greedy_top` on CUDA float32 logits `[T, E]`, k < E: one pass per token."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights = logits.new_empty((T, k))
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    margin = logits.new_empty((T,))
    block = 16
    wrap_triton(_greedy_top)[(triton.cdiv(T, block),)](
        logits, weights, ids, margin, T, E=E, BE=triton.next_power_of_2(E), K=k, SOFTMAX=softmax, BT=block,
        num_warps=4)
    return weights, ids, margin
