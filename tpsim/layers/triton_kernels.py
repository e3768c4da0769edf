"""Triton kernels for steps that inductor's generated code and PyTorch's kernels do slowly, each a
`torch.library.triton_op` so that a compiled region traces it whole. Imported only where Triton
is; `tpsim.layers.fused` holds the pure-tensor reference of each and chooses.

- `rope_assemble_qk`: inductor writes MLA's q and k heads as one flat loop with 14 masked loads
  per element, recomputing the shared k_pe rotation for every head.
- `greedy_top`: the router's softmax, top-(k+1) and gather were four kernels (torch.topk alone a
  radix select and a bitonic sort), for 64 scores a token.
- `expert_gate_up`: the routed experts' gather into expert order, gate/up GEMM and silu * up as one
  persistent kernel. PyTorch's grouped GEMM computes each expert's rows in whole 256-row clusters
  (V2-Lite at 8192 tokens: 15.6 % padding) and writes gate and up for a second pass; here the tiles
  are 128 rows, the rows are read from the tokens where they are (in L2) instead of a gathered copy,
  and only silu(gate) * up is written.
- `expert_places`: the rows' stable order by expert, each expert's end and each row's place, as a
  counting sort in three kernels; PyTorch's radix sort with its memsets and copy, the binary search for
  the ends and the inverse's scatter were eight launches a MoE layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# device-side TMA descriptors (tl.make_tensor_descriptor) take their scratch from this allocator
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


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


# measured on the H200 (benchmarks/results/probes-issue17/expert-gate-up.json): 128-row tiles of 128 gate and
# 128 up columns, 64-deep k steps, 3 stages; groups of 4 row tiles sweep the columns, so that an expert's
# weights are read while its rows are in L2
EXPERT_TILE = dict(BM=128, BH=128, BK=64, GROUP=4, num_warps=8, num_stages=3)


# decode-sized routings stay on the grouped GEMM: with the kernel at every size, V2-Lite's CUDA-graph forward
# on the H200 lost at 8 tokens (48 rows for 64 experts: 8.18 against 7.01 ms before the kernel) and won at
# 512 (48 rows an expert: 14.4 against 15.2 ms; benchmarks/results/probes-issue17/forward-cuda-first-run-of-
# 30b68f9.json against forward-cuda.json at eb58b70); the crossing between the two was not measured
MIN_ROWS_PER_EXPERT = 16


def fits_expert_gate_up(x: torch.Tensor, src: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether `expert_gate_up` takes these: bf16 on a Hopper GPU (TMA descriptors, measured there),
    at least MIN_ROWS_PER_EXPERT rows an expert on average, unit inner strides, the hidden size a
    multiple of the k step."""
    return (x.is_cuda and x.dtype == w13.dtype == torch.bfloat16 and x.stride(-1) == 1
            and src.shape[0] >= max(1, MIN_ROWS_PER_EXPERT * w13.shape[0])
            and w13.is_contiguous() and x.shape[-1] % EXPERT_TILE["BK"] == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


@triton.jit
def _expert_gate_up(x_ptr, src_ptr, w_ptr, ends_ptr, tile_ends_ptr, out_ptr, N, K, I, sx, NT, PROGRAMS,
                    E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                    GROUP: tl.constexpr):
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * 2 * I, K], strides=[K, 1], block_shape=[BH, BK])
    ei = tl.arange(0, BE)
    tile_ends = tl.load(tile_ends_ptr + ei, mask=ei < E, other=2 ** 30)
    m_tiles = tl.load(tile_ends_ptr + E - 1)
    for tile in range(tl.program_id(0), m_tiles * NT, PROGRAMS):
        first = tile // (GROUP * NT) * GROUP
        size = tl.minimum(m_tiles - first, GROUP)
        tm, tn = first + (tile - first * NT) % size, (tile - first * NT) // size
        e = tl.sum((tile_ends <= tm).to(tl.int32))  # the expert whose row tiles hold tile tm
        prev = tl.maximum(e - 1, 0)
        first_row, first_tile = tl.load(ends_ptr + prev), tl.load(tile_ends_ptr + prev)
        m0 = tl.where(e > 0, first_row, 0) + (tm - tl.where(e > 0, first_tile, 0)) * BM
        rows = m0 + tl.arange(0, BM)
        token = tl.load(src_ptr + tl.minimum(rows, N - 1)).to(tl.int64)  # rows past the expert's: computed, not stored
        a = x_ptr + token[:, None] * sx + tl.arange(0, BK)[None, :]
        gate_row = e * 2 * I + tn * BH
        g = tl.zeros((BM, BH), tl.float32)
        u = tl.zeros((BM, BH), tl.float32)
        for k in range(0, K, BK):
            xk = tl.load(a + k)
            g = tl.dot(xk, w_desc.load([gate_row, k]).T, g)
            u = tl.dot(xk, w_desc.load([gate_row + I, k]).T, u)
        g = g.to(tl.bfloat16).to(tl.float32)  # rounded as the GEMM's bf16 output is
        u = u.to(tl.bfloat16).to(tl.float32)
        cols = tn * BH + tl.arange(0, BH)
        keep = (rows < tl.load(ends_ptr + e))[:, None] & (cols < I)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], (g * tl.sigmoid(g) * u).to(tl.bfloat16),
                 mask=keep)


@triton_op("tpsim::expert_gate_up", mutates_args={})
def expert_gate_up(x: torch.Tensor, src: torch.Tensor, w13: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """As `fused.expert_gate_up` (`fits_expert_gate_up` says when it applies): one persistent kernel, one
    program per SM."""
    N, (E, I2, K) = src.shape[0], w13.shape
    I, c = I2 // 2, EXPERT_TILE
    tiles = (torch.diff(ends, prepend=ends.new_zeros(1)) + c["BM"] - 1) // c["BM"]
    tile_ends = torch.cumsum(tiles, 0).to(torch.int32)
    out = x.new_empty((N, I))
    programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    wrap_triton(_expert_gate_up)[(programs,)](
        x, src, w13, ends, tile_ends, out, N, K, I, x.stride(0), triton.cdiv(I, c["BH"]), programs,
        E=E, BE=triton.next_power_of_2(E), BM=c["BM"], BH=c["BH"], BK=c["BK"], GROUP=c["GROUP"],
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


# rows a program ranks at once: its [rows, experts] one-hot table stays this many elements; one program
# turns the blocks' counts into starts, so past this many blocks the radix sort takes over (V2-Lite:
# 262,144 rows, 43k tokens; 256 experts: 65,536 rows)
PLACES_TABLE, PLACES_BLOCKS = 16384, 1024


def _places_tile(count: int) -> tuple[int, int]:
    """(experts padded to a power of two, at least 16; rows a block)."""
    width = max(16, triton.next_power_of_2(count))
    return width, PLACES_TABLE // width


def fits_expert_places(experts: torch.Tensor, count: int) -> bool:
    """Whether `expert_places` takes these: CUDA, rows in one dimension, 1 to 1024 experts, at most
    PLACES_BLOCKS blocks of rows."""
    return (experts.is_cuda and experts.dim() == 1 and 0 < count <= 1024
            and 0 < experts.shape[0] <= PLACES_BLOCKS * _places_tile(count)[1])


@triton.jit
def _expert_counts(ids_ptr, counts_ptr, N, BE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + i, mask=i < N, other=-1)
    hit = (e[:, None] == tl.arange(0, BE)[None, :]).to(tl.int32)
    tl.store(counts_ptr + tl.program_id(0) * BE + tl.arange(0, BE), tl.sum(hit, axis=0))


@triton.jit
def _expert_starts(counts_ptr, starts_ptr, ends_ptr, P, E, BE: tl.constexpr, BP: tl.constexpr):
    """One program: where each block's rows of each expert start (the experts' starts plus the rows of
    the blocks before), and each expert's end."""
    cols = tl.arange(0, BE)
    total = tl.zeros((BE,), tl.int32)
    for q0 in range(0, P, BP):
        q = q0 + tl.arange(0, BP)
        total += tl.sum(tl.load(counts_ptr + q[:, None] * BE + cols[None, :], mask=(q < P)[:, None], other=0), axis=0)
    ends = tl.cumsum(total, axis=0)
    tl.store(ends_ptr + cols, ends, mask=cols < E)
    start = ends - total
    for q0 in range(0, P, BP):
        q = q0 + tl.arange(0, BP)
        at = q[:, None] * BE + cols[None, :]
        c = tl.load(counts_ptr + at, mask=(q < P)[:, None], other=0)
        tl.store(starts_ptr + at, start[None, :] + tl.cumsum(c, axis=0) - c, mask=(q < P)[:, None])
        start += tl.sum(c, axis=0)


@triton.jit
def _expert_places(ids_ptr, starts_ptr, order_ptr, back_ptr, N, BE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, BE)
    e = tl.load(ids_ptr + i, mask=i < N, other=-1)
    hit = (e[:, None] == cols[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1  # rows of its expert before it in this block
    start = tl.load(starts_ptr + tl.program_id(0) * BE + cols)
    place = tl.sum(hit * start[None, :], axis=1) + rank
    tl.store(order_ptr + place, i.to(tl.int64), mask=i < N)
    tl.store(back_ptr + i, place.to(tl.int64), mask=i < N)


@triton_op("tpsim::expert_places", mutates_args={})
def expert_places(experts: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `fused.expert_places` (`fits_expert_places` says when it applies): blocks of rows count their
    experts, one program turns the counts into each block's starts, then each block places its rows
    after the blocks before it, in row order: the stable sort's order."""
    experts = experts.contiguous()
    N, (BE, block) = experts.shape[0], _places_tile(count)
    P = triton.cdiv(N, block)
    counts = torch.empty((P, BE), dtype=torch.int32, device=experts.device)
    starts = torch.empty_like(counts)
    order, back = torch.empty_like(experts, dtype=torch.int64), torch.empty_like(experts, dtype=torch.int64)
    ends = torch.empty(count, dtype=torch.int32, device=experts.device)
    wrap_triton(_expert_counts)[(P,)](experts, counts, N, BE=BE, BLOCK=block, num_warps=8)
    wrap_triton(_expert_starts)[(1,)](counts, starts, ends, P, count, BE=BE, BP=block, num_warps=8)
    wrap_triton(_expert_places)[(P,)](experts, starts, order, back, N, BE=BE, BLOCK=block, num_warps=8)
    return order, ends, back
