"""Block-FP8 kernels in Triton: the activation's per-token-group quantization and one block-scaled
GEMM that serves the routed experts (rows grouped by expert, one program per SM sweeping every
expert's tiles) and the dense projections (one group). Imported only where Triton is;
`tpsim.layers.fp8` holds the float32 reference of each and chooses.

The GEMM is SGLang's and vLLM's Triton `fused_moe` with `use_fp8_w8a8` and a `block_shape`
(sglang `srt/layers/moe/fused_moe_triton/fused_moe.py`, vllm `model_executor/layers/fused_moe/
fused_moe.py`): for each 128-deep k step an FP8 x FP8 product accumulated in float32, times the
activation row's scale and the weight block's scale. For the experts' gate/up it computes the
gate and the up columns of one 128-wide group together and writes silu(gate) * up quantized
(one scale per row and group: what the down projection's activation quantization would compute),
so the [rows, 2I] product and the intermediate are never written in bf16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# device-side TMA descriptors (tl.make_tensor_descriptor) take their scratch from this allocator
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

FP8_MAX = tl.constexpr(448.0)  # tpsim.layers.fp8.FP8_MAX, as a constant a kernel can read
GROUP_K = 128  # the k step: one activation group and one weight block deep (DeepSeek-V3's 128 x 128)


@dataclass(frozen=True)
class Tile:
    """One launch's tile: BM rows by 128 columns (one weight block; gate/up: one quantization group),
    GROUP row tiles sweeping the columns together, Triton's warps and pipeline stages."""

    BM: int
    GROUP: int = 4
    num_warps: int = 4
    num_stages: int = 4


def tile_for(rows: int, groups: int, gate_up: bool) -> Tile:
    """The tile for `rows` rows over `groups` groups, as measured on the H200 at DeepSeek-V3's shapes and 2048
    tokens, 64 rows an expert (benchmarks/fp8_kernels.py --sweep: results/probes-issue37/fp8-kernels-sweep.json):
    gate/up on tiles of the rows a group gets on average (a power of two, 16 to 128), eight warps, eight row
    tiles sweeping the columns (2.36 ms against 2.74 with four warps and four); every other GEMM on 128-row
    tiles, eight warps (the experts' down: 1.28 against 1.48 ms on 64-row tiles), each group's tiles alone
    (GROUP 1) where there are groups."""
    if not gate_up:
        return Tile(128, GROUP=1 if groups > 1 else 4, num_warps=8, num_stages=4)
    bm = min(128, max(16, triton.next_power_of_2(max(1, rows // max(1, groups)))))
    return Tile(bm, GROUP=8, num_warps=8, num_stages=3 if bm == 128 else 4)


@triton.jit
def _act_quant(x_ptr, q_ptr, s_ptr, T, K, sx, NG, BT: tl.constexpr, G: tl.constexpr):
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    g = tl.program_id(1)
    k = g * G + tl.arange(0, G)
    keep = (t < T)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + t[:, None] * sx + k[None, :], mask=keep, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1e-12)
    q = tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv)
    tl.store(q_ptr + t[:, None] * K + k[None, :], q, mask=keep)
    tl.store(s_ptr + t * NG + g, scale, mask=t < T)


@triton_op("tpsim::fp8_act_quant", mutates_args={})
def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `tpsim.layers.fp8.act_quant` on a CUDA `[T, K]` (unit inner stride), bit for bit."""
    T, K = x.shape
    n = triton.cdiv(K, group)
    q = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, n), dtype=torch.float32, device=x.device)
    block = 16
    if T:
        wrap_triton(_act_quant)[(triton.cdiv(T, block), n)](x, q, s, T, K, x.stride(0), n, BT=block, G=group,
                                                             num_warps=4)
    return q, s


@triton.jit
def _silu_mul_quant(gate, up, keep):
    """silu(gate) * up of a [rows, 128] tile, rounded as the reference's bf16 GEMM outputs and silu * up are,
    quantized as act_quant does: (float8 values, one scale a row)."""
    g = gate.to(tl.bfloat16).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32)
    h = tl.where(keep, (s * up.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32), 0.0)
    amax = tl.max(tl.abs(h), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1e-12)
    return tl.math.div_rn(h, scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _grouped_fp8(a_ptr, as_ptr, src_ptr, w_ptr, ws_ptr, ends_ptr, out_ptr, os_ptr,
                 M, N, K, W_ROWS, sa, sas, sws_e, sws_n, NT, PROGRAMS, E,
                 BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP: tl.constexpr, GATHER: tl.constexpr, GATE_UP: tl.constexpr, DENSE: tl.constexpr):
    # the weight tiles through a TMA descriptor (zero past K and past the last row); the activation rows gathered
    # with 32-bit offsets (`fits` bounds the tensor); BN == BK == the weight block, so one scale a weight tile.
    # Each group's row tiles are counted here (no launches before this one); DENSE: one group, every row
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * W_ROWS, K], strides=[K, 1], block_shape=[BN, BK])
    ei = tl.arange(0, BE)
    if DENSE:
        m_tiles = tl.cdiv(M, BM)
    else:
        ends = tl.load(ends_ptr + ei, mask=ei < E, other=0)  # lanes past E: no rows, no tiles
        starts = tl.load(ends_ptr + ei - 1, mask=(ei > 0) & (ei < E), other=0)
        tiles = (ends - starts + BM - 1) // BM
        tile_ends = tl.cumsum(tiles, axis=0)
        m_tiles = tl.max(tile_ends, axis=0)
    kk = tl.arange(0, BK)
    for tile in range(tl.program_id(0), m_tiles * NT, PROGRAMS):
        first = tile // (GROUP * NT) * GROUP  # GROUP row tiles sweep the columns: the expert's weights in L2
        size = tl.minimum(m_tiles - first, GROUP)
        tm, tn = first + (tile - first * NT) % size, (tile - first * NT) // size
        if DENSE:
            e, m0, end = 0, tm * BM, M
        else:
            e = tl.sum((tile_ends <= tm).to(tl.int32))  # the group whose row tiles hold tile tm
            at = ei == e
            first_tile = tl.sum(tl.where(at, tile_ends - tiles, 0))
            m0 = tl.sum(tl.where(at, starts, 0)) + (tm - first_tile) * BM
            end = tl.sum(tl.where(at, ends, 0))
        rows = m0 + tl.arange(0, BM)
        clamped = tl.minimum(rows, M - 1)  # rows past the expert's: computed, not stored
        arow = tl.load(src_ptr + clamped).to(tl.int32) if GATHER else clamped
        a_ptrs = a_ptr + (arow * sa)[:, None] + kk[None, :]
        as_ptrs = as_ptr + arow * sas
        n0 = tn * BN
        gate_row, s_ptr = e * W_ROWS + n0, ws_ptr + e * sws_e + (n0 // BK) * sws_n
        up_s_ptr = ws_ptr + e * sws_e + ((n0 + N) // BK) * sws_n
        acc = tl.zeros((BM, BN), tl.float32)
        up = tl.zeros((BM, BN), tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            a = tl.load(a_ptrs, mask=(kk < K - kb * BK)[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb)[:, None]
            acc += tl.dot(a, w_desc.load([gate_row, kb * BK]).T) * (a_s * tl.load(s_ptr + kb))
            if GATE_UP:
                up += tl.dot(a, w_desc.load([gate_row + N, kb * BK]).T) * (a_s * tl.load(up_s_ptr + kb))
            a_ptrs += BK
        cols = n0 + tl.arange(0, BN)
        keep = (rows < end)[:, None] & (cols < N)[None, :]
        out_at = tl.arange(0, BM)[:, None] * N + cols[None, :]
        out_base = out_ptr + m0.to(tl.int64) * N
        if GATE_UP:
            h, scale = _silu_mul_quant(acc, up, keep)
            tl.store(out_base + out_at, h, mask=keep)
            tl.store(os_ptr + rows.to(tl.int64) * NT + tn, scale, mask=rows < end)
        else:
            tl.store(out_base + out_at, acc.to(out_ptr.dtype.element_ty), mask=keep)


def fits(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMM takes these: 32-bit offsets into the activation, TMA's 16-byte rows of the weight."""
    return a.numel() < 2 ** 31 and w.shape[-1] % 16 == 0


@functools.cache
def _programs(device: torch.device) -> int:
    """One program per SM (a persistent kernel)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def launch(aq, as_, src, w, ws, ends, out, out_scale, N: int, gate_up: bool, tile: Tile | None = None) -> None:
    """One `_grouped_fp8` over every group's rows, `ends` None: one group of every row (the ops below;
    benchmarks/fp8_kernels.py sweeps `tile` here)."""
    (E, W_ROWS, K), M = w.shape, out.shape[0]
    t = tile or tile_for(M, E, gate_up)
    programs = _programs(aq.device)
    wrap_triton(_grouped_fp8)[(programs,)](
        aq, as_, src, w, ws, ends, out, out_scale, M, N, K, W_ROWS, aq.stride(0), as_.stride(0),
        ws.stride(0), ws.stride(1), triton.cdiv(N, GROUP_K), programs, E,
        BE=triton.next_power_of_2(E), BM=t.BM, BN=GROUP_K, BK=GROUP_K, GROUP=t.GROUP,
        GATHER=src is not None, GATE_UP=gate_up, DENSE=ends is None, num_warps=t.num_warps,
        num_stages=t.num_stages)


@triton_op("tpsim::fp8_expert_gate_up", mutates_args={})
def expert_gate_up(xq: torch.Tensor, xs: torch.Tensor, src: torch.Tensor, w13: torch.Tensor, w13_s: torch.Tensor,
                   ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `xq[src]` (scales `xs[src]`) grouped by expert (group e ends at `ends[e]`), each times its
    expert's `w13 [E, 2I, K]` (gate | up; block scales `w13_s`) → silu(gate) * up quantized as
    `act_quant(h, 128)` does: (`[N, I]` float8_e4m3fn, `[N, I/128]` float32)."""
    N, I = src.shape[0], w13.shape[1] // 2
    out = torch.empty((N, I), dtype=torch.float8_e4m3fn, device=xq.device)
    out_scale = torch.empty((N, triton.cdiv(I, GROUP_K)), dtype=torch.float32, device=xq.device)
    if N:
        launch(xq, xs, src, w13, w13_s, ends, out, out_scale, I, gate_up=True)
    return out, out_scale


@triton_op("tpsim::fp8_grouped_mm", mutates_args={})
def grouped_mm(aq: torch.Tensor, as_: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, ends: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of `aq` (scales `as_`) grouped by `ends`, group e times `w[e]^T` (`w [E, N, K]`, block
    scales `ws [E, N/128, K/128]`) → `[rows, N]` in `out_dtype`."""
    M, N = aq.shape[0], w.shape[1]
    out = torch.empty((M, N), dtype=out_dtype, device=aq.device)
    if M:
        launch(aq, as_, None, w, ws, ends, out, out, N, gate_up=False)
    return out


@triton_op("tpsim::fp8_mm", mutates_args={})
def mm(aq: torch.Tensor, as_: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`aq [M, K]` (scales `as_ [M, K/128]`) times `w^T` (`w [N, K]`, block scales `ws`) → `[M, N]` in `out_dtype`."""
    M, N = aq.shape[0], w.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=aq.device)
    if M:
        launch(aq, as_, None, w[None], ws[None], None, out, out, N, gate_up=False)
    return out
