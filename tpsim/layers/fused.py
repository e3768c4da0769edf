"""The memory-bound pieces of a layer as pure tensor functions, eager or compiled, and whole
sublayers compiled as one region each.

Eager, each function here is several kernels that each read and write the whole `[T, width]`
tensor (casts to float32, the add, the norm, the weight; the rotation and the q/k concatenations;
silu and the product; the weighted sum over a token's experts; the router's float32 copies). The
eager functions are the reference and the CPU path. A model's `KernelPolicy` (`--compile`, on by
default on CUDA) puts its forwards of at least MIN_TOKENS tokens on the compiled path, for the extent
of that forward (`forward_kernels`):

- `region`: MLA attention and the MoE block each run as one `torch.compile`d graph (`fullgraph`,
  shapes specialized), in which inductor fuses across what would be separate kernels (the gather
  back from expert order into the weighted sum, silu * up into the grouped GEMM's input);
- `kernels()`: everything else (the layer's add + RMSNorm) calls each function compiled alone;
- on CUDA with Triton, four steps run as Triton kernels (tpsim.layers.triton_kernels), in a region
  and out of one, where inductor's code or PyTorch's kernel for them was slow: MLA's q/k assembly
  with q's rotation, a greedy router's softmax and top-k, the rows' order by expert (a counting
  sort), and the routed experts' gather, gate/up GEMM and silu * up.

A region runs only when no tap inside it is listened to (`Probe.listening`: a `tpsim capture` of
named points runs those sublayers eagerly), and the EAGLE-3 capture reads the stream between
sublayers, outside every compiled function, so a capture never adds a guard or a recompile.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tpsim.layers.sinks import sink_attention, sink_attention_flex


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


def rope_assemble_qk(q: torch.Tensor, k_pe: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """MLA's query and key heads `[T, h, nope | rope]`: q `[T, h, nope | rope]` with its rope part
    rotated by `cos`, `sin` here; k from kv `[T, h, nope | v]` (its first nope dims) and the rotated
    k_pe head `[T, 1, rope]` every head shares."""
    rope = k_pe.shape[-1]
    q_nope, q_pe = q.split([q.shape[-1] - rope, rope], dim=-1)
    return assemble_qk(q_nope, rope_pairs(q_pe, cos, sin), kv[..., :q_nope.shape[-1]], k_pe)


def rope_assemble_qk_fast(q, k_pe, kv, cos, sin):
    """`rope_assemble_qk` as one Triton kernel where it fits (tpsim.layers.triton_kernels)."""
    if _triton is not None and _triton.fits_rope_assemble(q, k_pe, kv):
        return _triton.rope_assemble_qk(q, k_pe, kv, cos, sin)
    return rope_assemble_qk(q, k_pe, kv, cos, sin)


def expert_gate_up(x: torch.Tensor, src: torch.Tensor, w13: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The routed experts' first half: rows `x[src]` `[N, hidden]`, grouped by expert (group e ends at
    `ends[e]`), each times its expert's `w13 [E, 2I, hidden]` (gate | up) → silu(gate) * up `[N, I]`."""
    return silu_mul(torch._grouped_mm(x[src], w13.transpose(-2, -1), offs=ends))


def expert_gate_up_fast(x, src, w13, ends):
    """`expert_gate_up` as one Triton kernel where it fits (tpsim.layers.triton_kernels)."""
    if _triton is not None and _triton.fits_expert_gate_up(x, src, w13):
        return _triton.expert_gate_up(x, src, w13, ends)
    return expert_gate_up(x, src, w13, ends)


def expert_order(experts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert: (their stable order `[N]`, the int32 end of each of the `count` experts'
    rows in it, as torch._grouped_mm takes `offs`). The ends come from a binary search of the sorted
    ids, not from counting with index_add_: compiled, that became a sort-based index_put, 0.17 ms a
    layer at 8192 tokens on the H200. uint8 keys where the ids fit: one radix-sort pass over 8-bit keys
    where int32 takes four."""
    order = experts.to(torch.uint8 if count <= 256 else torch.int32).argsort(stable=True)
    ends = torch.searchsorted(experts[order], torch.arange(count, device=experts.device), right=True)
    return order, ends.to(torch.int32)


def expert_groups(ends: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of each expert with rows, from `expert_order`'s ends: the per-expert
    fallbacks' loop (it reads the ends on the host: one sync)."""
    ends_ = ends.tolist()
    return [(e, a, b) for e, (a, b) in enumerate(zip([0] + ends_[:-1], ends_)) if b > a]


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation `[N]`: `x[perm][inverse_permutation(perm)] == x`."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))


def expert_places(experts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_order`'s (order, ends) and each row's place in that order `[N]` (its inverse)."""
    order, ends = expert_order(experts, count)
    return order, ends, inverse_permutation(order)


def expert_places_fast(experts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_places` as a counting sort in three Triton kernels where it fits (tpsim.layers.triton_kernels)."""
    if _triton is not None and _triton.fits_expert_places(experts, count):
        return _triton.expert_places(experts, count)
    return expert_places(experts, count)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MoE router's logits in float32, as transformers computes them: a float32 GEMM of the
    float32 copies of x and the gate weight."""
    return F.linear(x.float(), weight.float())


def router_logits_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same logits from a bf16 GEMM that accumulates and writes float32 (`torch.mm(...,
    out_dtype=float32)`, CUDA only): bf16 values and their products are exact in float32, so only
    the order of the float32 sum differs from `router_logits`, and neither x nor the weight is copied
    to float32 first (measured on the H200 at 8192 tokens: 0.04 vs 0.13 ms a layer)."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return router_logits(x, weight)


def weighted_sum(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs `y [T, k, hidden]` weighted by `weights [T, k]` (rounded once to
    y's dtype) and summed in float32, cast back to y's dtype: one batched [1, k] x [k, hidden] product
    per token (eager: a float32 copy of y would cost more than the product)."""
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1)


def weighted_sum_fused(weights: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same sum written elementwise, which torch.compile fuses into one pass over y (a compiled
    bmm stays a batched GEMV)."""
    return (y.float() * weights.to(y.dtype).float().unsqueeze(-1)).sum(1).to(y.dtype)


def top_k_margin(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the indices of the k largest scores `[T, k]`, the margin `[T]`: the k-th largest minus the
    (k+1)-th, inf when nothing competes), from one topk: how much a perturbation must move the
    scores to change the pick."""
    if scores.shape[-1] <= k:
        return scores.topk(k, dim=-1).indices, torch.full(scores.shape[:1], float("inf"), device=scores.device)
    top = scores.topk(k + 1, dim=-1)
    gap = top.values[:, k - 1] - top.values[:, k]
    return top.indices[:, :k], torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf")))


def greedy_top(logits: torch.Tensor, k: int, softmax: bool):
    """A greedy router's pick from float32 logits `[T, E]`: (the picked scores `[T, k]`, their
    experts `[T, k]`, the margin `[T]`), scores the softmax or the sigmoid of the logits."""
    scores = logits.softmax(-1) if softmax else logits.sigmoid()
    ids, margin = top_k_margin(scores, k)
    return scores.gather(1, ids), ids, margin


def greedy_top_fast(logits: torch.Tensor, k: int, softmax: bool):
    """`greedy_top` as one Triton kernel on CUDA float32 logits (tpsim.layers.triton_kernels)."""
    if _triton is not None and logits.is_cuda and logits.dtype == torch.float32 and 0 < logits.shape[0] \
            and k < logits.shape[-1]:  # T may be 0 (EP): no kernel to launch
        return _triton.greedy_top(logits, k, softmax)
    return greedy_top(logits, k, softmax)


@dataclass(frozen=True)
class Kernels:
    add_rms_norm: Callable
    rms_norm: Callable
    silu_mul: Callable
    rope_pairs: Callable
    rope_assemble_qk: Callable
    weighted_sum: Callable
    router_logits: Callable
    greedy_top: Callable
    expert_gate_up: Callable
    expert_places: Callable
    sink_attention: Callable


EAGER = Kernels(add_rms_norm, rms_norm, silu_mul, rope_pairs, rope_assemble_qk, weighted_sum, router_logits,
                greedy_top, expert_gate_up, expert_places, sink_attention)
# what a compiled region traces: the fusible forms, uncompiled (the region compiles them with the rest),
# and the Triton kernels where inductor's own code was slower
FUSIBLE = Kernels(add_rms_norm, rms_norm, silu_mul, rope_pairs, rope_assemble_qk_fast, weighted_sum_fused,
                  router_logits_fp32_out, greedy_top_fast, expert_gate_up_fast, expert_places_fast, sink_attention_flex)
# The CLI's threshold. With the regions the compiled forward is faster at every token count on the H200
# (benchmarks/results/forward-cuda.json, V2-Lite bf16, same rounds: 8 tokens 53.1 vs 76.3 ms eager, 512:
# 39.1 vs 58.7, 4096: 54.0 vs 77.8, 8192: 97.8 vs 139.2), but every new token count compiles its graphs
# first (5-12 s), and a `tpsim check` forwards each count a few times: only long prefills pay that back
MIN_TOKENS = 4096
# regions specialize on shapes (dynamic kernels were slower: silu * up at 8192 tokens 0.20 vs 0.17 ms), so
# each token count and dtype is a graph; beyond this many a region runs eagerly
RECOMPILE_LIMIT = 64
_compiled: Kernels | None = None  # a cache: compiled on first use, shared by every model of the process
_triton = None  # tpsim.layers.triton_kernels, once the compiled kernels found CUDA and Triton
_active = EAGER  # the kernels of the forward running now (`forward_kernels`): eager outside every forward


def compiled_kernels() -> Kernels:
    """The compiled kernels (compiled on first use; the Triton ones where CUDA and Triton are there)."""
    global _compiled, _triton
    if _compiled is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if torch.cuda.is_available():
            try:
                from tpsim.layers import triton_kernels as _triton
            except ImportError:  # no Triton: the compiled regions fuse the reference forms
                _triton = None
        each = (torch.compile(f, dynamic=None) for f in (add_rms_norm, rms_norm, silu_mul, rope_pairs))
        _compiled = Kernels(*each, rope_assemble_qk_fast, torch.compile(weighted_sum_fused, dynamic=None),
                            router_logits_fp32_out, greedy_top_fast, expert_gate_up_fast, expert_places_fast,
                            sink_attention_flex)
    return _compiled


@dataclass(frozen=True)
class KernelPolicy:
    """Which kernels one model's forwards use (`--compile`): the compiled ones in forwards of at least
    `min_tokens` tokens, else the eager ones. A model holds its own; nothing outlives its forward."""

    compiled: bool = False
    min_tokens: int = MIN_TOKENS

    def kernels(self, tokens: int) -> Kernels:
        return compiled_kernels() if self.compiled and tokens >= self.min_tokens else EAGER


EAGER_POLICY = KernelPolicy()


@contextmanager
def forward_kernels(policy: KernelPolicy, tokens: int):
    """For the extent of one forward of `tokens` tokens: the kernels its layers call (`kernels()`,
    `region`), the outer ones back after it."""
    global _active
    outer, _active = _active, policy.kernels(tokens)
    try:
        yield
    finally:
        _active = outer


def kernels() -> Kernels:
    return _active


_regions: dict[Callable, Callable] = {}


def region(forward: Callable, *args, eligible: bool = True):
    """`forward(*args)`, a sublayer's whole forward (a bound method), compiled as one region when the
    compiled kernels are active and the caller says it is `eligible`: no tap listened to, no
    collective, no host sync inside (a region must trace whole: `fullgraph`). Inductor then fuses
    across the kernels above (the router's top-k with its softmax, the gather back from expert order
    with the weighted sum) and specializes on the shapes. One compiled function per method, shared
    by every instance: the modules are inlined and their weights are graph inputs, so the layers of
    one kind share one graph per token count."""
    global _active
    if _active is EAGER or not eligible:
        return forward(*args)
    fn = forward.__func__
    if fn not in _regions:
        _regions[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    outer, _active = _active, FUSIBLE
    try:
        return _regions[fn](forward.__self__, *args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # a graph per shape and dtype, up to RECOMPILE_LIMIT
        _active = outer
        return forward(*args)
    finally:
        _active = outer
