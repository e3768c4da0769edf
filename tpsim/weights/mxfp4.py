"""MXFP4 expert weights, as GPT-OSS publishes them (openai/gpt-oss-20b, -120b).

An expert weight `{name}` (`gate_up_proj`, `down_proj`) is stored as `{name}_blocks` uint8
`[..., rows, G, 16]` and `{name}_scales` uint8 `[..., rows, G]`: each byte holds two FP4 (e2m1)
codes, the low nibble first, and each group of 32 values along a row shares one E8M0 scale,
the value being `FP4_VALUES[code] * 2**(scale - 127)`. Dequantized, a row is `[G * 32]` and
the last two dims are swapped, giving the Hugging Face parameter layout `[..., G * 32, rows]`
(`gate_up_proj` `[E, hidden, 2 * I]`, `down_proj` `[E, I, hidden]`).

Source: transformers 5.24, transformers/integrations/mxfp4.py (`FP4_VALUES`,
`_convert_moe_packed_tensors`, which this matches bit for bit in float32: same table, same
`torch.ldexp`, same transpose).
"""

from __future__ import annotations

import math

import torch

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 code -> value (bit 3 is the sign)
GROUP = 32  # values per scale
FP4_MAX = 6.0


def _span(s, n: int) -> tuple[int, int, bool]:
    """(start, stop, keep the dim) of an int or contiguous slice over a dim of size n."""
    if isinstance(s, int):
        i = s + n if s < 0 else s
        if not 0 <= i < n:
            raise IndexError(f"index {s} out of range for a dim of size {n}")
        return i, i + 1, False
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError("mxfp4 slices must be contiguous")
    return start, max(start, stop), True


def unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks `[..., rows, G, 16]`, scales `[..., rows, G]` → float32 `[..., rows, G * 32]`
    (the stored layout, not yet transposed)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8).long()  # int64: an index, and >> on uint8 is not supported everywhere
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-3)  # low nibble first
    exp = (scales.to(torch.int32) - 127).repeat_interleave(GROUP, dim=-1)
    return torch.ldexp(vals, exp)  # as transformers: 2**(s - 127) overflows to inf at s = 255 (E8M0's NaN)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The whole float32 tensor in the Hugging Face layout `[..., G * 32, rows]` (transformers'
    `convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)`)."""
    return unpack(blocks, scales).transpose(-1, -2).contiguous()


def _shape(t) -> tuple[int, ...]:
    return tuple(t.get_shape()) if hasattr(t, "get_shape") else tuple(t.shape)  # safetensors slice or tensor


class Mxfp4Source:
    """A lazily sliced MXFP4 tensor, indexed in the Hugging Face layout `[..., G * 32, rows]`.

    `src[e]`, `src[e0:e1, a:b]`, `src[e, :, c0:c1]`, `src[:]` (ints and contiguous slices, one per
    leading dim) return that part dequantized to float32, reading from `blocks` and `scales`
    (tensors or safetensors `get_slice` objects) only the rows it needs and the 32-value groups
    it touches.
    """

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales
        *lead, rows, G, B = _shape(blocks)
        if B != GROUP // 2 or _shape(scales) != (*lead, rows, G):
            raise ValueError(f"not mxfp4 blocks/scales: {_shape(blocks)} and {_shape(scales)}")
        self.shape = (*lead, G * GROUP, rows)

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(self.shape):
            raise IndexError(f"{len(idx)} indices for a {len(self.shape)}-dim tensor")
        idx = idx + (slice(None),) * (len(self.shape) - len(idx))
        spans = [_span(s, n) for s, n in zip(idx, self.shape)]
        lead = [slice(a, b) for a, b, _ in spans[:-2]]
        (c0, c1, _), (r0, r1, _) = spans[-2:]
        g0, g1 = c0 // GROUP, math.ceil(c1 / GROUP)
        # lazy safetensors slices take plain slices only: ints become length-1 slices, squeezed below
        b = self.blocks[(*lead, slice(r0, r1), slice(g0, g1))]
        s = self.scales[(*lead, slice(r0, r1), slice(g0, g1))]
        out = unpack(b, s)[..., c0 - g0 * GROUP:c1 - g0 * GROUP].transpose(-1, -2)
        drop = [d for d, (_, _, keep) in enumerate(spans) if not keep]
        return out.reshape([n for d, n in enumerate(out.shape) if d not in drop]).contiguous()


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float tensor in the Hugging Face layout `[..., cols, rows]` (cols a multiple of 32) →
    (blocks uint8 `[..., rows, cols/32, 16]`, scales uint8 `[..., rows, cols/32]`), so that
    `dequantize` gives it back rounded to MXFP4: each group's scale is the smallest power of two
    that brings its largest magnitude to at most 6, each value the nearest e2m1 value (ties to the
    smaller magnitude), saturating at +-6. Exact for a tensor already on that grid."""
    x = w.float().transpose(-1, -2)
    *lead, rows, cols = x.shape
    if cols % GROUP:
        raise ValueError(f"mxfp4 groups of {GROUP} do not divide {cols}")
    g = x.reshape(*lead, rows, cols // GROUP, GROUP)
    amax = g.abs().amax(-1)
    # e = ceil(log2(amax / 6)), made exact: log2 of a float32 may be off by an ulp at a power of two
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP4_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
    e = e + (amax > torch.ldexp(torch.full_like(amax, FP4_MAX), e.int())).float()
    e = e - ((amax <= torch.ldexp(torch.full_like(amax, FP4_MAX), e.int() - 1)) & (amax > 0)).float()
    e = e.clamp(-127, 127).int()
    q = torch.ldexp(g, -e[..., None]).clamp(-FP4_MAX, FP4_MAX)
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    code = (q.abs()[..., None] - grid).abs().argmin(-1)  # argmin takes the first: the smaller magnitude
    code = code | (torch.signbit(q).long() << 3)
    code = code.reshape(*lead, rows, cols // GROUP, GROUP // 2, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    return blocks.contiguous(), (e + 127).to(torch.uint8).contiguous()
