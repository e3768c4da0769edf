"""An independent, textbook DeepSeek-V2/V3 forward on full (unsharded) Hugging Face weights.

Written separately from tpsim's layers on purpose: plain residual `x = x + f(norm(x))`,
explicit masked softmax attention, complex-number (DeepSeek reference style) interleaved
RoPE, per-token expert loop. float32 only. Returns the residual stream at every boundary,
i.e. HF's `output_hidden_states` except that index L is out(L-1) here and `final` is separate.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpsim.capture import PositionKind


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def yarn_inv_freq(dim, base, rs):
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not rs:
        return freqs, 1.0
    factor, orig = rs["factor"], rs.get("original_max_position_embeddings", 4096)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rs.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = freqs / factor * (1 - smooth) + freqs * smooth

    def m(s, ms):
        return 1.0 if s <= 1 else 0.1 * ms * math.log(s) + 1.0

    return freqs, m(factor, rs.get("mscale", 1)) / m(factor, rs.get("mscale_all_dim", 0) or 0)


def rope(x, pos, inv_freq, mscale):
    """x `[T, h, d]` rotated in adjacent pairs via complex multiplication."""
    cis = torch.polar(torch.full((len(pos), len(inv_freq)), mscale), pos[:, None].float() * inv_freq[None])
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[:, None]).flatten(-2)


def attention(cfg, W, p, x):
    T, Hn = x.shape[0], cfg.num_attention_heads
    nope, rdim, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = x @ W[p + "q_proj.weight"].T
    else:
        qa = rms(x @ W[p + "q_a_proj.weight"].T, W[p + "q_a_layernorm.weight"], cfg.rms_norm_eps)
        q = qa @ W[p + "q_b_proj.weight"].T
    q = q.view(T, Hn, nope + rdim)
    kv_a = x @ W[p + "kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv_a[:, :cfg.kv_lora_rank], kv_a[:, cfg.kv_lora_rank:]
    kv = (rms(c, W[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps) @ W[p + "kv_b_proj.weight"].T).view(T, Hn, nope + vd)
    inv_freq, mscale = yarn_inv_freq(rdim, cfg.rope_theta, cfg.rope_scaling)
    pos = torch.arange(T)
    q = torch.cat([q[..., :nope], rope(q[..., nope:], pos, inv_freq, mscale)], -1)
    k = torch.cat([kv[..., :nope], rope(k_pe[:, None], pos, inv_freq, mscale).expand(T, Hn, rdim)], -1)
    v = kv[..., nope:]
    scale = (nope + rdim) ** -0.5
    if cfg.rope_scaling and cfg.rope_scaling.get("mscale_all_dim"):
        ms = 0.1 * cfg.rope_scaling["mscale_all_dim"] * math.log(cfg.rope_scaling["factor"]) + 1.0
        scale *= ms * ms if cfg.rope_scaling["factor"] > 1 else 1.0
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, Hn * vd)
    return out @ W[p + "o_proj.weight"].T


def swiglu(W, p, x):
    return (F.silu(x @ W[p + "gate_proj.weight"].T) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def route(cfg, W, p, x):
    """Per token: list of (expert, weight)."""
    logits = x @ W[p + "gate.weight"].T
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    G, tg = cfg.n_group or 1, cfg.topk_group or 1
    out = []
    for t in range(x.shape[0]):
        s = scores[t]
        choice = s + W[p + "gate.e_score_correction_bias"] if cfg.topk_method == "noaux_tc" else s.clone()
        if cfg.topk_method != "greedy":
            per = E // G
            group_score = [choice[g * per:(g + 1) * per].max() if cfg.topk_method == "group_limited_greedy"
                           else choice[g * per:(g + 1) * per].topk(2).values.sum() for g in range(G)]
            keep = torch.tensor(group_score).topk(tg).indices.tolist()
            for g in range(G):
                if g not in keep:
                    choice[g * per:(g + 1) * per] = float("-inf")
        ids = choice.topk(k).indices
        w = s[ids]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        out.append(list(zip(ids.tolist(), w.tolist())))
    return out


def moe(cfg, W, p, x):
    y = torch.zeros_like(x)
    for t, picks in enumerate(route(cfg, W, p, x)):
        for e, w in picks:
            y[t] += w * swiglu(W, f"{p}experts.{e}.", x[t:t + 1])[0]
    y = y * cfg.routed_scaling_factor
    if cfg.n_shared_experts:
        y = y + swiglu(W, p + "shared_experts.", x)
    return y


def reference_states(cfg, W: dict, input_ids: torch.Tensor):
    """(residual stream at boundaries 0..L as a list of `[T, H]`, final-norm output `[T, H]`)."""
    x = W["model.embed_tokens.weight"][input_ids]
    states = [x]
    for k in range(cfg.num_hidden_layers):
        p = f"model.layers.{k}."
        x = x + attention(cfg, W, p + "self_attn.", rms(x, W[p + "input_layernorm.weight"], cfg.rms_norm_eps))
        h = rms(x, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + (moe(cfg, W, p + "mlp.", h) if cfg.is_moe_layer(k) else swiglu(W, p + "mlp.", h))
        states.append(x)
    return states, rms(x, W["model.norm.weight"], cfg.rms_norm_eps)


def reference_capture(cfg, W, input_ids, positions) -> torch.Tensor:
    states, final = reference_states(cfg, W, input_ids)
    return torch.cat([final if p.kind is PositionKind.FINAL else states[p.boundary] for p in positions], -1)
