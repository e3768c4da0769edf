"""configs/deepseek-v2-lite.yaml and configs/deepseek-v3.yaml are the published models.

The published values below are the architecture fields of deepseek-ai/DeepSeek-V2-Lite(-Chat)
and deepseek-ai/DeepSeek-V3(-0324) config.json, as collected in the project's research notes
(shared/research/tp-layers.md §5, which cites the sources). The parameter counts are the
published model sizes: 15.7 B and 671 B (the latter without the MTP layer).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tpsim.weights.reader import expected_tensors
from tpsim.config.loader import load_config, with_overrides

ROOT = Path(__file__).resolve().parents[1]
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(num_key_value_heads=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              rope_theta=10000, max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu",
              tie_word_embeddings=False)
PUBLISHED = {
    "deepseek-v2-lite": dict(
        COMMON, model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        q_lora_rank=None, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
        intermediate_size=10944, first_k_dense_replace=1, moe_layer_freq=1, vocab_size=102400, n_group=1,
        topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "deepseek-v3": dict(
        COMMON, model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
        intermediate_size=18432, first_k_dense_replace=3, moe_layer_freq=1, vocab_size=129280, n_group=8,
        topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
PARAMS_B = {"deepseek-v2-lite": 15.7, "deepseek-v3": 671.0}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_matches_published_field_for_field(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    for field, value in PUBLISHED[name].items():
        got = getattr(cfg, field)
        if field == "num_key_value_heads":  # published = num_attention_heads (MLA)
            assert got == cfg.num_attention_heads
        else:
            assert got == value, f"{name}: {field} is {got!r}, published {value!r}"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_is_the_published_size(name):
    shapes = expected_tensors(load_config(ROOT / "configs" / f"{name}.yaml"))
    billions = sum(math.prod(s) for s in shapes.values()) / 1e9
    assert round(billions, 1) == PARAMS_B[name]


def test_truncated_v3_keeps_real_shapes():
    """`--override num_hidden_layers=4`: three dense layers and one MoE layer at V3's shapes."""
    shapes = expected_tensors(with_overrides(load_config(ROOT / "configs/deepseek-v3.yaml"), ["num_hidden_layers=4"]))
    assert shapes["model.layers.0.self_attn.q_a_proj.weight"] == (1536, 7168)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes["model.layers.2.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["model.layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert shapes["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert not any(n.startswith("model.layers.4.") for n in shapes)
