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

from tpsim.layers.fp8 import FP8_MAX, BlockFp8, block_slice, dequantize, quantize, scale_shape

__all__ = ["FP8_MAX", "Fp8Source", "dequantize", "quantize", "scale_shape"]


def _span(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError("fp8 slices must be contiguous")
    return start, max(start, stop)


class Fp8Source:
    """A lazily sliced fp8 weight and its block scales. `src[rows]`, `src[rows, cols]` or
    `src[:]` returns that part of the weight dequantized to float32 (`raw`: kept in fp8, a
    `BlockFp8` of the part's values and scales), reading from the file only the fp8 values of
    the part and the scales of the blocks it touches."""

    def __init__(self, weight, scale_inv, block: tuple[int, int], shape: tuple[int, int], raw: bool = False):
        self.weight, self.scale_inv, self.block, self.shape, self.raw = weight, scale_inv, block, shape, raw

    def __getitem__(self, idx) -> "torch.Tensor | BlockFp8":
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (2 - len(idx))
        (r0, r1), (c0, c1) = (_span(s, n) for s, n in zip(idx, self.shape))
        if self.raw:  # the fp8 values and their scales as stored (the part must follow the blocks)
            return self._blocks(r0, r1, c0, c1)
        # the whole blocks around the part, dequantized, then cropped to it
        (bo, bi), (n, m) = self.block, self.shape
        a0, a1 = r0 // bo * bo, min(math.ceil(r1 / bo) * bo, n)
        b0, b1 = c0 // bi * bi, min(math.ceil(c1 / bi) * bi, m)
        return self._blocks(a0, a1, b0, b1).dequantize()[r0 - a0:r1 - a0, c0 - b0:c1 - b0]

    def _blocks(self, r0: int, r1: int, c0: int, c1: int) -> BlockFp8:
        """Rows r0:r1 and columns c0:c1, on block boundaries, as stored, with their blocks' scales."""
        (r, sr), (c, sc) = (block_slice(slice(a, b), n, blk, what) for a, b, n, blk, what in
                            ((r0, r1, self.shape[0], self.block[0], "rows"),
                             (c0, c1, self.shape[1], self.block[1], "columns")))
        return BlockFp8(self.weight[r, c], self.scale_inv[sr, sc].float(), self.block)
