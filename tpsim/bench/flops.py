"""FLOPs and all-reduces of one forward by formula, from the config alone (benchmarks/forward.py, forward_tp.py)."""

from __future__ import annotations

from tpsim.run.jobs import DTYPES


def active_params(cfg) -> dict:
    """Matmul weights one token multiplies through in a forward (embedding lookup excluded,
    lm_head included; MoE layers: router + shared experts + top_k routed experts; MLA:
    q_proj (or q_a_proj + q_b_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj; GQA: the q, k and v
    projections and o_proj). Norm weights,
    the e_score_correction_bias and RoPE are not matmuls and are not counted."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.mla:
        qk, nope, v = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        q = H * heads * qk if cfg.q_lora_rank is None else H * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
        attn = q + H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (nope + v) \
            + heads * v * H
    else:  # GQA: the qkv GEMM and o_proj
        d = cfg.attention_head_dim
        attn = H * (heads + 2 * cfg.kv_heads) * d + heads * d * H
    dense = 3 * H * cfg.intermediate_size
    L, n_moe = cfg.num_hidden_layers, cfg.moe_layer_count()
    moe = 0
    if n_moe:
        moe = (H * cfg.n_routed_experts + 3 * H * cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
               + 3 * H * cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    lm_head = H * cfg.vocab_size
    total = L * attn + (L - n_moe) * dense + n_moe * moe + lm_head
    return {"attention_per_layer": attn, "dense_mlp_per_layer": dense, "moe_per_layer": moe,
            "dense_layers": L - n_moe, "moe_layers": n_moe, "lm_head": lm_head, "total": total}


FLOP_FORMULA = ("flops(T) = 2*T*P_active + L*T^2*heads*(qk_head_dim + v_head_dim); P_active = matmul weights per "
                "token (embedding lookup excluded, lm_head over vocab_size included; MoE: router + shared + top_k "
                "routed experts; MLA: q_proj or q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj; GQA: q/k/v_proj, "
                "o_proj); attention: causal prefill of T tokens counted as T^2/2 query-key pairs, 2 flops per "
                "multiply-add, for QK^T (qk_head_dim; GQA head_dim) and PV (v_head_dim; GQA head_dim) in each of L layers; norms, RoPE, softmax, activations, routing "
                "and the final logits slice not counted")


def forward_flops(cfg, T: int) -> dict:
    """FLOPs of one forward of one sequence of T tokens (FLOP_FORMULA)."""
    p = active_params(cfg)
    dense = 2 * T * p["total"]
    qk, v = (cfg.qk_head_dim, cfg.v_head_dim) if cfg.mla else (cfg.attention_head_dim, cfg.attention_head_dim)
    attention = cfg.num_hidden_layers * T * T * cfg.num_attention_heads * (qk + v)
    return {"matmul": dense, "attention": attention, "total": dense + attention}


def tp_all_reduces(cfg, T: int, dtype: str, tp: int) -> dict:
    """All-reduces of one forward at TP=tp by formula: pure TP runs 1 (embedding) + 2 per layer
    (o_proj, MLP/MoE), each of this rank's `[T, hidden]` activation in `dtype` (what `tpsim
    check` counts from the collective trace at TP > 1); none at TP=1. The lm_head's all-gather of
    logits is not an all-reduce and is not counted here."""
    n = 0 if tp == 1 else 1 + 2 * cfg.num_hidden_layers
    return {"tp": tp, "all_reduces": n, "bytes": n * T * cfg.hidden_size * DTYPES[dtype].itemsize}
