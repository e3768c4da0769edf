"""Causal attention with a learned sink logit per head (GPT-OSS), optionally in a sliding window.

`sink_attention` is the reference: the scores materialised in float32, the sink concatenated as an
extra logit (transformers' `eager_attention_forward`), `[H, Tq, Tk]` floats a layer (at 8192 tokens and
64 heads, 17 GB). `sink_attention_flex` computes the same without the scores: flex attention (one
Triton kernel per mask, compiled by torch.compile; the window and causality as a block mask, the KV
heads read in place by each group of query heads) returns the attention without the sink and its
log-sum-exp L per query and head; the sink s only adds exp(s) to the softmax's denominator, so the
output with the sink is that output times exp(L) / (exp(L) + exp(s)) = sigmoid(L - s) (`with_sinks`).
"""

from __future__ import annotations

import functools

import torch
from einops import einsum, rearrange, repeat
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   window: int | None = None, scale: float | None = None, first: int | None = None) -> torch.Tensor:
    """Causal attention with a learned sink logit per head: q `[Tq, H, d]`, k and v `[Tk, Hkv, d]`
    (H a multiple of Hkv; query head i reads KV head i // (H/Hkv)), sinks `[H]` → `[Tq, H, d]`.

    Each head's sink joins its softmax denominator and contributes no value (transformers'
    `eager_attention_forward` concatenates it as an extra logit and drops its probability).
    The queries are the last Tq of the Tk positions (Tq == Tk for a prefill), or positions first..first+Tq-1
    (context parallelism: this rank's tokens among every rank's keys). Window
    convention (transformers `sliding_window_overlay` with `config.sliding_window`, and vLLM's
    `per_layer_sliding_window`): the query at position i sees keys j with i - window < j <= i,
    i.e. `window` keys counting itself; None: every j <= i. Logits and softmax in float32.
    """
    Tq, H, d = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    if H % Hkv:
        raise ValueError(f"{Hkv} KV heads do not divide {H} query heads")
    k, v = (repeat(t.float(), "s h d -> s (h g) d", g=H // Hkv) for t in (k, v))
    logits = einsum(q.float(), k, "t h d, s h d -> h t s") * (d ** -0.5 if scale is None else scale)
    start = Tk - Tq if first is None else first
    i = torch.arange(start, start + Tq, device=q.device)[:, None]
    j = torch.arange(Tk, device=q.device)[None, :]
    seen = (j <= i) if window is None else (j <= i) & (j > i - window)
    logits = logits.masked_fill(~seen, float("-inf"))
    sink = repeat(sinks.float(), "h -> h t 1", t=Tq)
    probs = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
    return einsum(probs, v, "h t s, s h d -> t h d").to(q.dtype)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks `out [H, T, d]` and its log-sum-exp `lse [H, T]` (natural log) → the attention
    with each head's sink logit `sinks [H]` in its softmax, in out's dtype."""
    keep = torch.sigmoid(lse.float() - sinks.float()[:, None])
    return (out.float() * keep[..., None]).to(out.dtype)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=8)
def _block_mask(T: int, window: int | None, device: torch.device):
    """Query i sees key j when j <= i (and i - window < j): the mask of `sink_attention`'s window convention."""
    def causal(b, h, i, j):
        return j <= i

    def sliding(b, h, i, j):
        return (j <= i) & (j > i - window)
    return create_block_mask(causal if window is None else sliding, None, None, T, T, device=device)


def sink_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        window: int | None = None, scale: float | None = None, first: int | None = None) -> torch.Tensor:
    """`sink_attention` through compiled flex attention where `flex_applies`; elsewhere the reference."""
    if not flex_applies(q, k, first):
        return sink_attention(q, k, v, sinks, window, scale, first)
    return flex_sinks(q, k, v, sinks, window, scale, _compiled_flex())


def flex_applies(q: torch.Tensor, k: torch.Tensor, first: int | None) -> bool:
    """Whether the compiled kernel takes this prefill: CUDA, Tq == Tk (`first` None), whole 128-row blocks and a
    head_dim of 64 or 128, as measured on the H200 (GPT-OSS-20B, d 64, 4096 and 8192 tokens); inductor found no
    kernel for T = 40 with d = 32 (NoValidChoicesError), and the shapes between were not measured."""
    T, d = q.shape[0], q.shape[-1]
    return q.is_cuda and first is None and k.shape[0] == T and T % 128 == 0 and d in (64, 128)


def flex_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None,
               scale: float | None, attend=flex_attention) -> torch.Tensor:
    """A prefill's sink attention, `[T, H, d]` q and `[T, Hkv, d]` k, v, by `attend` (flex attention,
    compiled or not) and `with_sinks`."""
    T, H, d = q.shape
    q4, k4, v4 = (rearrange(t, "t h d -> 1 h t d") for t in (q, k, v))
    out, lse = attend(q4, k4, v4, block_mask=_block_mask(T, window, q.device), scale=d ** -0.5 if scale is None else scale,
                      enable_gqa=True, return_lse=True)
    return rearrange(with_sinks(out[0], lse[0], sinks), "h t d -> t h d")
