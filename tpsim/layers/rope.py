"""Rotary embeddings: interleaved (GPT-J style, adjacent pairs) on DeepSeek's rope part of q and
k, and NeoX style (halves) on whole heads for Llama and Qwen; YaRN and Llama 3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from tpsim.layers.fused import kernels


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """`qk_head_dim**-0.5`, times YaRN's mscale(factor, mscale_all_dim)**2 when scaling is set."""
    scale = qk_head_dim ** -0.5
    if rope_scaling:
        m = yarn_get_mscale(rope_scaling["factor"], float(rope_scaling.get("mscale_all_dim", 0) or 0))
        scale *= m * m
    return scale


def yarn(inv_freq: torch.Tensor, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (vLLM `YaRNScalingRotaryEmbedding`, `DeepseekScalingRotaryEmbedding`): frequencies
    below the `beta_slow` rotations divided by `factor`, those above `beta_fast` kept, a linear
    ramp between; and the cos/sin scale mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    * attn_factor (0.1 ln(factor) + 1 when the config gives neither, as Qwen3's and Kimi-K2's).
    `truncate: false` (GPT-OSS) keeps the ramp's ends unrounded."""
    dim = 2 * inv_freq.shape[0]
    factor = scaling["factor"]
    orig_max = scaling.get("original_max_position_embeddings", 4096)
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
    low, high = _correction_dim(beta_fast, dim, base, orig_max), _correction_dim(beta_slow, dim, base, orig_max)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    mscale = (yarn_get_mscale(factor, scaling.get("mscale", 1))
              / yarn_get_mscale(factor, scaling.get("mscale_all_dim", 0) or 0) * scaling.get("attn_factor", 1))
    return inv_freq, mscale


class RopeTable(nn.Module):
    """The cos and sin of one positions tensor, `cos_sin(positions)`: computed once and shared by every
    layer built with the same rope settings (the layers of one forward get one positions tensor).
    Compiled with the rotation instead, the cos and sin were recomputed for each of the heads'
    elements in every layer (Llama-3.1-8B at 8192 tokens on an H200: 9.1 ms of 229.8)."""

    _tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # key → (positions, cos, sin)

    def __init__(self, style: str, dim: int, base: float, rope_scaling: dict | None, inv_freq: torch.Tensor,
                 mscale: float, device: torch.device):
        super().__init__()
        self.mscale = mscale
        self.register_buffer("inv_freq", inv_freq.float().to(device), persistent=False)
        self.key = (style, dim, base, repr(sorted((rope_scaling or {}).items())), str(torch.device(device)))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]` → (cos, sin) `[T, 1, dim/2]` float32, scaled by mscale."""
        held = self._tables.get(self.key)
        if held is not None and held[0] is positions:  # the table holds positions, so `is` cannot see a reused id
            return held[1], held[2]
        freqs = positions.float()[:, None] * self.inv_freq[None]  # [T, dim/2]
        cos, sin = (freqs.cos() * self.mscale)[:, None], (freqs.sin() * self.mscale)[:, None]
        self._tables[self.key] = (positions, cos, sin)
        return cos, sin


class DeepseekRotaryEmbedding(RopeTable):
    """Interleaved rotation of the rope part of MLA's q and k."""

    def __init__(self, rope_dim: int, base: float, rope_scaling: dict | None, device: torch.device):
        inv_freq = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
        mscale = 1.0
        if rope_scaling:
            inv_freq, mscale = yarn(inv_freq, base, rope_scaling)
        super().__init__("interleaved", rope_dim, base, rope_scaling, inv_freq, mscale, device)

    @staticmethod
    def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], *xs: torch.Tensor) -> list[torch.Tensor]:
        """each x `[T, heads, rope_dim]` → rotated by the table `cos_sin`, same shape and dtype."""
        return [kernels().rope_pairs(x, *cos_sin) for x in xs]


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling (`rope_type: llama3`; transformers `_compute_llama3_parameters`,
    vLLM `Llama3RotaryEmbedding`): long wavelengths divided by `factor`, short ones kept, a smooth
    blend between `original_max_position_embeddings / low_freq_factor` and `/ high_freq_factor`."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > old / low, inv_freq / factor, torch.where(wavelen < old / high, inv_freq, blended))


class NeoxRotaryEmbedding(RopeTable):
    """Rotary embedding on whole heads, halves rotated (GPT-NeoX style: Llama, Qwen), with no
    scaling, `llama3` or `yarn` scaling."""

    def __init__(self, head_dim: int, base: float, rope_scaling: dict | None, device: torch.device):
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        mscale = 1.0
        if kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "yarn":
            inv_freq, mscale = yarn(inv_freq, base, rope_scaling)
        elif kind != "default":
            raise ValueError(f"rope_scaling type {kind!r} is not supported for this attention (default, llama3, yarn)")
        super().__init__("halves", head_dim, base, rope_scaling, inv_freq, mscale, device)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor):
        """positions `[T]`; each x `[T, heads, head_dim]` → rotated, same shape and dtype."""
        return self.rotate(self.cos_sin(positions), *xs)

    @staticmethod
    def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], *xs: torch.Tensor) -> list[torch.Tensor]:
        """each x `[T, heads, head_dim]` → its halves rotated by the table `cos_sin`, same shape and dtype."""
        cos, sin = cos_sin
        out = []
        for x in xs:
            a, b = x.float().chunk(2, dim=-1)
            out.append(torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype))
        return out
