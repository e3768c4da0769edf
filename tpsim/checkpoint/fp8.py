"""Block-wise FP8 weights, as DeepSeek-V3 publishes them.

A quantized linear weight `W [out, in]` is stored as `float8_e4m3fn` next to
`W_scale_inv [ceil(out/bo), ceil(in/bi)]` (float32): the full-precision weight is
`fp8 * scale_inv` of its `bo x bi` block (`quantization_config.weight_block_size`, 128x128
for DeepSeek-V3). Dequantization is done in float32, as DeepSeek's `weight_dequant` does,
then cast to the model dtype by the parameter copy.
"""

from __future__ import annotations

import math

import torch


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError("fp8 slices must be contiguous")
    return start, max(start, stop)


class Fp8Source:
    """A lazily sliced fp8 weight and its block scales. `src[rows]`, `src[rows, cols]` or
    `src[:]` returns that part of the weight dequantized to float32, reading from the file
    only the fp8 values of the part and the scales of the blocks it touches."""

    def __init__(self, weight, scale_inv, block: tuple[int, int], shape: tuple[int, int]):
        self.weight, self.scale_inv, self.block, self.shape = weight, scale_inv, block, shape

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (2 - len(idx))
        (r0, r1), (c0, c1) = (_span(s, n) for s, n in zip(idx, self.shape))
        bo, bi = self.block
        w = self.weight[r0:r1, c0:c1].float()
        s = self.scale_inv[r0 // bo:math.ceil(r1 / bo), c0 // bi:math.ceil(c1 / bi)].float()
        s = s.repeat_interleave(bo, 0).repeat_interleave(bi, 1)
        return w * s[r0 - r0 // bo * bo:r1 - r0 // bo * bo, c0 - c0 // bi * bi:c1 - c0 // bi * bi]


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [out, in]` → (float8_e4m3fn `[out, in]`, float32 scale_inv `[ceil(out/bo), ceil(in/bi)]`),
    one scale per block so its largest magnitude maps to 448."""
    bo, bi = block
    so, si = scale_shape(tuple(w.shape), block)
    padded = torch.zeros(so * bo, si * bi, dtype=torch.float32)
    padded[:w.shape[0], :w.shape[1]] = w.float()
    blocks = padded.view(so, bo, si, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(so * bo, si * bi)
    return q[:w.shape[0], :w.shape[1]].contiguous(), scale


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The whole float32 weight: each `bo x bi` block of `q` times its scale."""
    s = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * s[:q.shape[0], :q.shape[1]]
