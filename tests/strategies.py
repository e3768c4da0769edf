"""Hypothesis strategies: TP degree first, then sizes divisible by construction."""

from __future__ import annotations

from hypothesis import strategies as st

from tpsim.capture import resolve
from tpsim.config import config_from_dict

TP_DEGREES = [1, 2, 4, 8]

# The valid id range of each convention for L layers.
ID_RANGES = {"sglang": lambda L: (-1, L - 2), "vllm": lambda L: (0, L), "specforge": lambda L: (0, L - 1),
             "hf": lambda L: (0, L), "eagle": lambda L: (0, L - 1)}


@st.composite
def config_dicts(draw, tp: int, max_layers: int = 3, moe=None):
    """An HF-style config dict that `tp` divides (vocab deliberately not a multiple of 64 or tp)."""
    L = draw(st.integers(1, max_layers), label="num_hidden_layers")
    d = {
        "hidden_size": draw(st.sampled_from([16, 32, 48]), label="hidden"),
        "num_hidden_layers": L,
        "num_attention_heads": tp * draw(st.integers(1, 2), label="heads_per_rank"),
        "vocab_size": draw(st.integers(2, 300), label="vocab"),
        "intermediate_size": tp * 8 * draw(st.integers(1, 2)),
        "q_lora_rank": draw(st.sampled_from([None, 16]), label="q_lora_rank"),
        "kv_lora_rank": draw(st.sampled_from([8, 16])),
        "qk_nope_head_dim": draw(st.sampled_from([4, 8])),
        "qk_rope_head_dim": draw(st.sampled_from([2, 4, 8])),
        "v_head_dim": draw(st.sampled_from([4, 8, 12])),
        # mscale and mscale_all_dim drawn equal (V2/V3's published value) and apart: when equal, the cos/sin
        # factor is 1 and a softmax scale that took the wrong one of them was caught only by the parity test
        "rope_scaling": draw(st.sampled_from([None] + [
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
             "mscale": m, "mscale_all_dim": m_all} for m, m_all in ((0.707, 0.707), (1.0, 0.707), (0.707, 1.0))]),
            label="rope_scaling"),
    }
    if moe is None:
        moe = draw(st.booleans(), label="moe")
    if moe:
        method = draw(st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]), label="topk_method")
        n_group = 1 if method == "greedy" else draw(st.sampled_from([1, 2]))
        E = n_group * draw(st.sampled_from([2, 4]))
        topk_group = draw(st.integers(1, n_group))
        d.update({
            "n_routed_experts": E, "topk_method": method, "n_group": n_group, "topk_group": topk_group,
            "num_experts_per_tok": draw(st.integers(1, topk_group * (E // n_group))),
            "moe_intermediate_size": tp * 4 * draw(st.integers(1, 2)),
            "n_shared_experts": draw(st.sampled_from([None, 1, 2])),
            "first_k_dense_replace": draw(st.integers(0, L)), "moe_layer_freq": draw(st.sampled_from([1, 2])),
            "scoring_func": "sigmoid" if method == "noaux_tc" else draw(st.sampled_from(["softmax", "sigmoid"])),
            "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
        })
    config_from_dict(d)  # strategies only make valid configs
    return d


@st.composite
def captures(draw, L: int):
    """(convention, ids) valid for a model of L layers, resolved."""
    conv = draw(st.sampled_from(sorted(ID_RANGES)), label="convention")
    lo, hi = ID_RANGES[conv](L)
    ids = draw(st.lists(st.integers(lo, hi), min_size=1, max_size=4), label="ids")
    return resolve(conv, ids, L)
