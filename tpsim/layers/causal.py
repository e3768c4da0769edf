"""Causal scaled-dot-product attention, over the whole sequence or (context parallelism) this rank's
queries over every rank's keys, and `HeadAttention`, what the TP attention blocks (GQA, MLA) share:
their points, and this rank's heads attended and sent through the row-parallel o_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from tpsim.layers.linear import RowParallelLinear
from tpsim.layers.probe import NamedPoint, Tapped
from tpsim.parallel.context import Keys


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     shards: Keys | None = None) -> torch.Tensor:
    """q `[1, h, Tq, d]`, k and v `[1, h or kv, Tk, d]` (kv dividing h: grouped) → `[1, h, Tq, d]`. `shards` None: Tq == Tk, query i
    sees keys 0..i; else the queries are this rank's tokens and the keys all of them, masked by
    global token index (`Keys.causal_mask`: context parallelism, or the suffix after a cached prefix)."""
    gqa = k.shape[1] != q.shape[1]  # query head i reads KV head i // (h / kv), in SDPA: no repeated copy of K, V
    if shards is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=shards.causal_mask(q.device), scale=scale,
                                          enable_gqa=gqa)


class HeadAttention(Tapped, nn.Module):
    """An attention block split by heads: its own points (an `out` among them), then its o_proj's."""

    o_proj: RowParallelLinear

    @classmethod
    def points(cls, base: str) -> list[NamedPoint]:
        """This attention's points under `base`, then its o_proj's, in forward order."""
        return cls.declared(base) + RowParallelLinear.declared(f"{base}.o_proj")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, shards: Keys | None = None) -> torch.Tensor:
        """`shards`: context parallelism, x and positions this rank's tokens, or a prefix cache, x and
        positions the suffix's (the subclass's module docstring)."""
        raise NotImplementedError

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                shards: Keys | None) -> torch.Tensor:
        """q `[T, h, d]`, k and v `[T, h or kv, d]`, this rank's heads (kv: grouped) → o_proj's output."""
        # 4-D [1, h, T, d]: 3-D inputs send CUDA SDPA to its math fallback (30x slower at 8k tokens)
        q, k, v = (rearrange(t, "t h d -> 1 h t d") for t in (q, k, v))
        return self._project(rearrange(causal_attention(q, k, v, scale, shards), "1 h t d -> t (h d)"))

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        """The attention output `[T, h * d]` of this rank's heads, tapped as `out`, through o_proj."""
        self.tap("out", out)
        return self.o_proj(out)
