"""Hypothesis strategies: TP degree first, then sizes divisible by construction."""

from __future__ import annotations

from hypothesis import strategies as st

from tpsim.capture import Position
from tpsim.profiles.conventions import Convention, resolve
from tpsim.config.loader import config_from_dict

TP_DEGREES = [1, 2, 4, 8]

# The valid id range of each convention for L layers, as the conventions say (sglang-boundary's
# depends on the first id: not here).
ID_RANGES = {c.value: c.id_range for c in Convention if c.id_range(1) is not None}


FAMILY_TYPES = ["deepseek_v2", "llama", "qwen3", "qwen3_moe", "gpt_oss"]  # one model_type per tpsim family; Hypothesis
# shrinks towards DeepSeek, the family with the most structure (MLA, shared experts, grouped routing)
YARN_GQA = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
YARN_NO_TRUNCATE = {**YARN_GQA, "truncate": False}  # GPT-OSS
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


@st.composite
def config_dicts(draw, tp: int, max_layers: int = 3, moe=None, families=tuple(FAMILY_TYPES)):
    """An HF-style config dict of a drawn family that `tp` divides (vocab deliberately not a
    multiple of 64 or tp). `moe`: True/False to force MoE layers in or out; `families`: the
    model_types to draw from."""
    if moe is None:
        moe = draw(st.booleans(), label="moe")
    candidates = [t for t in families if (t == "deepseek_v2" or (t in ("qwen3_moe", "gpt_oss")) == moe)]
    model_type = draw(st.sampled_from(candidates), label="model_type")
    L = draw(st.integers(1, max_layers), label="num_hidden_layers")
    heads = tp * draw(st.integers(1, 2), label="heads_per_rank")
    d = {
        "model_type": model_type,
        "hidden_size": draw(st.sampled_from([16, 32, 48]), label="hidden"),
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "vocab_size": draw(st.integers(2, 300), label="vocab"),
        "intermediate_size": tp * 8 * draw(st.integers(1, 2)),
    }
    if model_type == "deepseek_v2":
        d.update(_mla(draw))
        if moe:
            d.update(_deepseek_moe(draw, tp, L))
        return _valid(d)
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16) if heads % k == 0 and (k % tp == 0 or tp % k == 0)]),
              label="kv_heads")
    d.update(num_key_value_heads=kv, head_dim=draw(st.sampled_from([4, 8]), label="head_dim"),
             rope_scaling=draw(st.sampled_from([None, LLAMA3 if model_type == "llama" else
                                                YARN_GQA if model_type != "gpt_oss" else YARN_NO_TRUNCATE]),
                               label="rope_scaling"),
             attention_bias=draw(st.booleans(), label="attention_bias"),
             tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"))
    if model_type == "qwen3_moe":
        E = draw(st.sampled_from([2, 4, 8]), label="num_experts")
        d.update(num_experts=E, num_experts_per_tok=draw(st.integers(1, E), label="top_k"),
                 moe_intermediate_size=tp * 4 * draw(st.integers(1, 2)), norm_topk_prob=draw(st.booleans()),
                 decoder_sparse_step=draw(st.integers(1, 2), label="decoder_sparse_step"),
                 mlp_only_layers=draw(st.lists(st.integers(0, L - 1), max_size=1), label="mlp_only_layers"))
    if model_type == "gpt_oss":  # every layer MoE; experts of intermediate_size
        E = draw(st.sampled_from([2, 4, 8]), label="num_experts")
        d.update(num_local_experts=E, num_experts_per_tok=draw(st.integers(1, E), label="top_k"),
                 intermediate_size=tp * 4 * draw(st.integers(1, 2)),
                 sliding_window=draw(st.integers(1, 6), label="sliding_window"),
                 layer_types=draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=L,
                                           max_size=L), label="layer_types"),
                 swiglu_limit=draw(st.sampled_from([7.0, 0.5]), label="swiglu_limit"))
    return _valid(d)


def _mla(draw) -> dict:
    return {
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


def _deepseek_moe(draw, tp: int, L: int) -> dict:
    method = draw(st.sampled_from(["greedy", "group_limited_greedy", "noaux_tc"]), label="topk_method")
    n_group = 1 if method == "greedy" else draw(st.sampled_from([1, 2]))
    E = n_group * draw(st.sampled_from([2, 4]))
    topk_group = draw(st.integers(1, n_group))
    return {
        "n_routed_experts": E, "topk_method": method, "n_group": n_group, "topk_group": topk_group,
        "num_experts_per_tok": draw(st.integers(1, topk_group * (E // n_group))),
        "moe_intermediate_size": tp * 4 * draw(st.integers(1, 2)),
        "n_shared_experts": draw(st.sampled_from([None, 1, 2])),
        "first_k_dense_replace": draw(st.integers(0, L)), "moe_layer_freq": draw(st.sampled_from([1, 2])),
        "scoring_func": "sigmoid" if method == "noaux_tc" else draw(st.sampled_from(["softmax", "sigmoid"])),
        "norm_topk_prob": draw(st.booleans()), "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
    }


def _valid(d: dict) -> dict:
    config_from_dict(d)  # strategies only make valid configs
    return d


@st.composite
def captures(draw, L: int):
    """(convention, ids) valid for a model of L layers, resolved."""
    conv = draw(st.sampled_from(sorted(ID_RANGES)), label="convention")
    lo, hi = ID_RANGES[conv](L)
    ids = draw(st.lists(st.integers(lo, hi), min_size=1, max_size=4), label="ids")
    return resolve(conv, ids, L)


@st.composite
def forward_cases(draw, tps=(1, 2, 4), min_tokens: int = 1, max_tokens: int = 9):
    """(tp, config dict, ascending positions at boundaries 0..L, seed, input ids): one drawn forward
    whose capture a test replays (the tests of one capture feature add their own draws)."""
    tp = draw(st.sampled_from(list(tps)), label="tp")
    cfg = draw(config_dicts(tp, max_layers=3))
    L = cfg["num_hidden_layers"]
    T = draw(st.integers(min_tokens, max_tokens), label="T")
    positions = draw(boundary_positions(L), label="positions")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    ids = draw(token_ids(cfg["vocab_size"], T), label="input_ids")
    return tp, cfg, positions, seed, ids


def boundary_positions(L: int):
    """1-3 distinct positions at boundaries 0..L (embed .. out(L-1)), ascending."""
    return st.lists(st.integers(0, L), min_size=1, max_size=3).map(
        lambda bs: sorted({Position.at_boundary(b) for b in bs}, key=Position.sort_key))


def token_ids(vocab_size: int, T: int):
    return st.lists(st.integers(0, vocab_size - 1), min_size=T, max_size=T)
