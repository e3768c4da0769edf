"""Causal scaled-dot-product attention, over the whole sequence or (context parallelism) this rank's
queries over every rank's keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpsim.parallel.context import Keys


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     shards: Keys | None = None) -> torch.Tensor:
    """q `[1, h, Tq, d]`, k and v `[1, h, Tk, d]` → `[1, h, Tq, d]`. `shards` None: Tq == Tk, query i
    sees keys 0..i; else the queries are this rank's tokens and the keys all of them, masked by
    global token index (`Keys.causal_mask`: context parallelism, or the suffix after a cached prefix)."""
    if shards is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=shards.causal_mask(q.device), scale=scale)
