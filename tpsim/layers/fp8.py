"""Block-scaled FP8 weights kept in FP8, and the GEMM that multiplies by them.

DeepSeek-V3 publishes its linear weights as `float8_e4m3fn` `W [out, in]` next to float32
`W_scale_inv [ceil(out/bo), ceil(in/bi)]`: the weight is `fp8 * scale_inv` of its `bo x bi` block
(128 x 128). Its inference code (deepseek-ai/DeepSeek-V3 `inference/kernel.py`: `act_quant`,
`fp8_gemm`) and the engines (vLLM `W8A8BlockFp8LinearOp`, SGLang `fp8_utils`) keep the weight in
FP8 and quantize the activation per token and per group of `bi` input columns, one float32
scale each, then multiply the two FP8 operands with both scales in a block-scaled GEMM.

`BlockFp8` is such a weight (or a stack of them, e.g. every expert's), sliceable in element
units along block boundaries, so a rank's loader copies its shard of the FP8 values and the
matching scales; `linear` multiplies by it: on CUDA with `torch._scaled_mm`'s block-wise
scaling (1 x 128 activation groups, 128 x 128 weight blocks), elsewhere by the same arithmetic in
float32 (quantized activation times dequantized weight), which is also the reference the GPU
kernel is tested against.

The routed experts (`experts`) multiply each expert's rows by its FP8 stack: on a CUDA GPU with
Triton one grouped kernel per projection (tpsim.layers.triton_fp8: the activation quantized once
per token, gate/up with silu * up and the down projection's quantization fused in), elsewhere one
reference GEMM per expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpsim.layers.fused import expert_groups, silu_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALED_MM_BLOCK = (128, 128)  # the block torch._scaled_mm's block-wise recipe takes
_triton = None  # tpsim.layers.triton_fp8 once a CUDA tensor found Triton; False where it is not there


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` → (float8_e4m3fn `[out, in]`, float32 scale_inv `[ceil(out/bo), ceil(in/bi)]`),
    one scale per block so its largest magnitude maps to 448."""
    bo, bi = block
    so, si = scale_shape(tuple(w.shape), block)
    padded = torch.zeros(so * bo, si * bi, dtype=torch.float32, device=w.device)
    padded[:w.shape[0], :w.shape[1]] = w.float()
    blocks = padded.view(so, bo, si, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).to(FP8).view(so * bo, si * bi)
    return q[:w.shape[0], :w.shape[1]].contiguous(), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The whole float32 weight: each `bo x bi` block of `q` times its scale."""
    s = scale_inv.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return q.float() * s[..., :q.shape[-2], :q.shape[-1]]


def act_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [T, K]` → (float8_e4m3fn `[T, K]`, float32 scales `[T, ceil(K/group)]`): one scale per token
    and per `group` input columns, its largest magnitude mapped to 448 (DeepSeek's `act_quant`)."""
    T, K = x.shape
    n = math.ceil(K / group)
    padded = F.pad(x.float(), (0, n * group - K)).view(T, n, group)
    amax = padded.abs().amax(-1)
    # a tensor divisor: CUDA divides by a Python scalar as a product with its float32 reciprocal, one ulp
    # off the CPU's quotient, and the ulp moved elements across fp8 rounding boundaries (H200, T=1, K=N=128,
    # seed 126: 2.7e-2 of the norm between a CPU and a GPU quantization of the same bf16 row)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(1e-12)
    q = (padded / scale[..., None]).to(FP8).view(T, n * group)[:, :K]
    return q, scale


def block_slice(s: slice, n: int, b: int, what: str) -> tuple[slice, slice]:
    """An element slice of a dimension of size n and the slice of its block scales; it must start
    on a block boundary and end on one or at n (a shard that splits a block has no scale of its own)."""
    start, stop, step = s.indices(n)
    stop = max(start, stop)
    if step != 1 or start % b or (stop % b and stop != n):
        raise ValueError(f"{what} [{start}:{stop}] of {n} does not follow the {b}-wide fp8 blocks")
    return slice(start, stop), slice(start // b, math.ceil(stop / b))


@dataclass
class BlockFp8:
    """A block-scaled FP8 matrix, or a stack of them: `q` `[..., out, in]` float8_e4m3fn,
    `scale_inv` `[..., ceil(out/bo), ceil(in/bi)]` float32, `block` `(bo, bi)`. Indexing takes
    integers or slices on the leading dims and block-aligned slices on the last two, and returns a
    view of both (what a loader copies a shard into)."""

    q: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def numel(self) -> int:
        return self.q.numel()

    def __getitem__(self, idx) -> "BlockFp8":
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (self.q.dim() - len(idx))
        lead, (rows, cols) = idx[:-2], idx[-2:]
        (r, sr), (c, sc) = (block_slice(s, n, b, what) for s, n, b, what in
                            zip((rows, cols), self.q.shape[-2:], self.block, ("rows", "columns")))
        return BlockFp8(self.q[(*lead, r, c)], self.scale_inv[(*lead, sr, sc)], self.block)

    def copy_(self, src: "BlockFp8 | torch.Tensor") -> None:
        """Copy FP8 values and scales from `src`; a full-precision matrix is quantized first (its
        blocks are this shard's blocks, so a seeded model's FP8 weights are the same at every TP)."""
        if not isinstance(src, BlockFp8):
            if src.dim() != 2:
                raise ValueError("only a matrix can be quantized into fp8 blocks")
            src = BlockFp8(*quantize(src, self.block), self.block)
        if src.block != self.block or src.q.shape != self.q.shape or src.scale_inv.shape != self.scale_inv.shape:
            raise ValueError(f"fp8 shard {tuple(src.q.shape)} (blocks {src.block}) does not fit "
                             f"{tuple(self.q.shape)} (blocks {self.block})")
        with torch.no_grad():
            self.q.copy_(src.q)
            self.scale_inv.copy_(src.scale_inv)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale_inv, self.block)


def _scaled_mm_fits(x: torch.Tensor, w: BlockFp8) -> bool:
    (N, K), (bo, bi) = w.q.shape, w.block
    return (x.is_cuda and w.block == _SCALED_MM_BLOCK and K % bi == 0 and N % bo == 0 and K % 16 == 0
            and x.shape[0] > 0)


def linear(x: torch.Tensor, w: "torch.Tensor | BlockFp8", bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ b)` for a weight in the model dtype or in FP8 blocks (the output in x's dtype)."""
    if not isinstance(w, BlockFp8):
        return F.linear(x, w, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    fast = _fast(x2, w)
    xq, xs = act_quant(x2, w.block[1]) if fast is None else fast.act_quant(x2, w.block[1])
    # torch._scaled_mm's block-wise GEMM where it takes the weight, the Triton GEMM where it does not (V3's
    # kv_a_proj, 576 rows). Measured on the H200 at V3's shapes and 2048 tokens (GPU time, benchmarks/results/
    # fp8-kernels-cuda.json): cuBLAS was faster than the Triton GEMM at every shape (o_proj 0.39 against 0.54 ms,
    # the dense MLP's gate/up 0.82 against 1.13) and than bf16 at all but the smallest (q_a_proj)
    if fast is not None and not _scaled_mm_fits(xq, w):
        y = fast.mm(xq, xs, w.q, w.scale_inv, x.dtype)
    else:
        y = quantized_mm(xq, xs, w, x.dtype)
    y = y.view(*lead, y.shape[-1])
    return y if bias is None else y + bias


def quantized_mm(xq: torch.Tensor, xs: torch.Tensor, w: BlockFp8, dtype: torch.dtype) -> torch.Tensor:
    """An activation already quantized by `act_quant` (`xq [T, K]`, `xs [T, K/bi]`) times `w^T`, in `dtype`."""
    K = xq.shape[1]
    if _scaled_mm_fits(xq, w):
        # cuBLAS's block-wise fp8 GEMM refuses some row counts: pad the rows to a multiple of 16
        # (zero rows, sliced off after). scale_a must be outer-dim major ([T, K/128] with stride
        # (1, T)); scale_b is [K/128, N/128]
        T = xq.shape[0]
        pad = -T % 16
        if pad:
            xq = torch.cat([xq, xq.new_zeros(pad, K)])
            xs = torch.cat([xs, xs.new_ones(pad, xs.shape[1])])
        wq, ws = w.q, w.scale_inv
        kb = ws.shape[1]
        if ws.shape[0] > 1 and kb % 4:
            # measured on the H200 (torch 2.11, CUDA 13): with more than one output block and K/128 not a
            # multiple of 4 the block-wise GEMM reads the wrong weight scales and returns garbage, no
            # error; zero columns (scale 1) up to a multiple of 4 blocks change nothing in the product
            extra = (4 - kb % 4) * w.block[1]
            xq = torch.cat([xq, xq.new_zeros(xq.shape[0], extra)], dim=1)
            xs = torch.cat([xs, xs.new_ones(xs.shape[0], 4 - kb % 4)], dim=1)
            wq = torch.cat([wq, wq.new_zeros(wq.shape[0], extra)], dim=1)
            ws = torch.cat([ws, ws.new_ones(ws.shape[0], 4 - kb % 4)], dim=1)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs.t().contiguous().t(), scale_b=ws.t(), out_dtype=dtype)[:T]
    a = xq.float() * xs.repeat_interleave(w.block[1], 1)[:, :K]
    return (a @ w.dequantize().t()).to(dtype)


def _fast(x: torch.Tensor, *weights: BlockFp8):
    """tpsim.layers.triton_fp8 where its kernels take these operands: CUDA bf16 on a GPU with FP8 tensor
    cores (sm89+), contiguous weights in 128 x 128 blocks."""
    global _triton
    fits = (x.is_cuda and x.dtype == torch.bfloat16 and x.stride(-1) == 1
            and all(w.block == _SCALED_MM_BLOCK and w.q.is_contiguous() and w.scale_inv.stride(-1) == 1
                    for w in weights)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))
    if not fits:
        return None
    if _triton is None:
        try:
            from tpsim.layers import triton_fp8 as _triton
        except ImportError:
            _triton = False
    return _triton if _triton and all(_triton.fits(x, w.q) for w in weights) else None


def grouped_mm(xq: torch.Tensor, xs: torch.Tensor, w: BlockFp8, ends: torch.Tensor, dtype: torch.dtype):
    """Quantized rows `xq [N, K]` (scales `xs`) grouped by expert (group e ends at `ends[e]`), group e
    times `w[e]^T` → `[N, out]` in `dtype`: one GEMM per expert (the reference; it syncs with the host
    once to read the ends)."""
    groups = expert_groups(ends)
    if not groups:
        return xq.new_empty((0, w.q.shape[-2]), dtype=dtype)
    return torch.cat([quantized_mm(xq[a:b], xs[a:b], w[e], dtype) for e, a, b in groups])


def experts(x: torch.Tensor, src: torch.Tensor, w13: BlockFp8, w2: BlockFp8, ends: torch.Tensor) -> torch.Tensor:
    """The routed experts in FP8: rows `x[src]` `[N, hidden]` grouped by expert (group e ends at
    `ends[e]`) → `[N, hidden]`, each row through its expert (gate | up stack `w13 [E, 2I, hidden]`,
    silu(gate) * up, down stack `w2 [E, hidden, I]`), each activation quantized per token and group."""
    fast = _fast(x, w13, w2)
    if fast is not None and w13.q.shape[-2] % 256 == 0:  # gate and up each whole 128-wide groups
        xq, xs = fast.act_quant(x, w13.block[1])  # once per token, not once per (token, expert) row
        hq, hs = fast.expert_gate_up(xq, xs, src, w13.q, w13.scale_inv, ends)
        return fast.grouped_mm(hq, hs, w2.q, w2.scale_inv, ends, x.dtype)
    xq, xs = act_quant(x[src], w13.block[1])
    h = silu_mul(grouped_mm(xq, xs, w13, ends, x.dtype))
    return grouped_mm(*act_quant(h, w2.block[1]), w2, ends, x.dtype)
