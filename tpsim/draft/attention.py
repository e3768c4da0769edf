"""The draft's attention: q/k/v read the [T, 2H] cat(embed, hidden), o_proj writes H. Steps past 0 run T
chains at once, one per prefix: row i sees step 0's keys 0..i and its own keys of steps 1..s, which is the
engines' chain decode for the prefix ending at i and SpecForge's TTT mask (`algorithms/eagle3/model.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from tpsim.draft.config import DraftConfig
from tpsim.layers.linear import QKVParallelLinear, RowParallelLinear
from tpsim.layers.rope import NeoxRotaryEmbedding
from tpsim.parallel.group import TPGroup


@dataclass
class DraftCache:
    """Rotated keys and values `[T, kv_heads, d]` of every step run so far, step 0 first."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def mask(self, t: int, device: torch.device) -> torch.Tensor:
        """`[T, steps*T]` bool: step 0 causal, every later step its diagonal only."""
        eye = torch.eye(t, dtype=torch.bool, device=device)
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        return torch.cat([causal] + [eye] * (len(self.keys) - 1), dim=1)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, group: TPGroup, prefix: str, dtype: torch.dtype):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          group, f"{prefix}.qkv_proj", dtype)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, group, f"{prefix}.o_proj", dtype)
        self.rotary_emb = NeoxRotaryEmbedding(d, cfg.rope_theta, cfg.rope_scaling, group.device)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, cache: DraftCache) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k, v = (rearrange(t, "t (h d) -> t h d", d=self.head_dim) for t in (q, k, v))
        q, k = self.rotary_emb(positions, q, k)
        cache.keys.append(k)
        cache.values.append(v)
        group = self.heads // self.kv_heads
        keys, values = (torch.cat(ts, dim=0).repeat_interleave(group, dim=1) for ts in (cache.keys, cache.values))
        q, keys, values = (rearrange(t, "t h d -> 1 h t d") for t in (q, keys, values))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=cache.mask(x.shape[0], x.device),
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(rearrange(out, "1 h t d -> t (h d)"))
