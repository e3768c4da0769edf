"""Grouped-query attention on real gloo ranks: each rank's KV heads are the reference's (split while
tp <= num_key_value_heads, replicated beyond, as vLLM's QKVParallelLinear does), and the layer
equals transformers' LlamaAttention (Qwen3Attention with per-head q/k norms) on the same weights
at every TP degree its heads allow."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from strategies import TP_DEGREES
from tpsim.layers import GQA, AttentionShape
from tpsim.parallel import TPGroup
from tpsim.run.jobs import rel_err
from tpsim.testing.jobs import gqa_job, layer_input
from tpsim.weights.seeded import init_tensor

PREFIX = "model.layers.0.self_attn"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # short: positions up to T cross every band


@st.composite
def shapes(draw):
    """A TP degree and an attention shape it can shard: tp divides the query heads, and the KV
    heads split (kv % tp == 0) or replicate (tp % kv == 0)."""
    tp = draw(st.sampled_from(TP_DEGREES), label="tp")
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k % tp == 0 or tp % k == 0]), label="kv_heads")
    heads = kv * draw(st.sampled_from([g for g in (1, 2, 4) if (kv * g) % tp == 0] or [tp]), label="group")
    if heads % tp:
        heads = tp * kv
    bias = draw(st.booleans(), label="bias")
    # transformers wants hidden_size divisible by the heads; head_dim is drawn apart (Qwen3-30B-A3B: 2048 / 32 != 128)
    shape = {"hidden_size": heads * draw(st.sampled_from([2, 4])), "num_attention_heads": heads,
             "num_key_value_heads": kv, "head_dim": draw(st.sampled_from([4, 8])),
             "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
             "rope_scaling": draw(st.sampled_from([None, LLAMA3])), "attention_bias": bias, "o_proj_bias": bias,
             "qk_norm_eps": draw(st.sampled_from([None, 1e-6]), label="qwen3 qk norm")}
    return tp, shape, draw(st.integers(0, 2**31 - 1), label="seed"), draw(st.integers(1, 24), label="T")


def full_weights(shape: dict, seed: int) -> dict[str, torch.Tensor]:
    layer = GQA(AttentionShape(**shape), TPGroup(), PREFIX, torch.float32)
    return {s.name.removeprefix(f"{PREFIX}."): init_tensor(seed, s.name, s.shape)
            for m in layer.modules() if hasattr(m, "weight_specs") for s in m.weight_specs()}


def transformers_attention(shape: dict, seed: int, T: int) -> torch.Tensor:
    """transformers' LlamaAttention, or Qwen3Attention (per-head q/k norms) when the shape has them."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
    rope = {"rope_type": "default", "rope_theta": shape["rope_theta"]} if shape["rope_scaling"] is None else \
        {**shape["rope_scaling"], "rope_theta": shape["rope_theta"]}
    qwen3 = shape["qk_norm_eps"] is not None
    cfg = (Qwen3Config if qwen3 else LlamaConfig)(
        hidden_size=shape["hidden_size"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"], rope_parameters=rope,
        attention_bias=shape["attention_bias"], max_position_embeddings=64,
        **({"rms_norm_eps": shape["qk_norm_eps"]} if qwen3 else {}))
    cfg._attn_implementation = "sdpa"
    attn = (Qwen3Attention if qwen3 else LlamaAttention)(cfg, layer_idx=0).eval()
    attn.load_state_dict(full_weights(shape, seed), strict=True)
    x = layer_input(seed, (T, shape["hidden_size"]), torch.float32)[None]
    cos_sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(T)[None])
    with torch.no_grad():
        return attn(x, position_embeddings=cos_sin, attention_mask=None)[0][0]


@settings(max_examples=25, deadline=None)
@given(case=shapes())
@example(case=(8, {"hidden_size": 16, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4,
                   "rope_theta": 500000.0, "rope_scaling": LLAMA3, "attention_bias": False, "o_proj_bias": False,
                   "qk_norm_eps": None},
               0, 9))  # Llama-3.1-8B's 32/8 ratio at TP 8: every KV head on two ranks
@example(case=(4, {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
                   "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": True, "o_proj_bias": True,
                   "qk_norm_eps": 1e-6},
               1, 5))  # multi-query: one KV head on every rank
def test_gqa_equals_transformers_and_each_rank_holds_its_kv_heads(rank_pool, case):
    tp, shape, seed, T = case
    out = rank_pool.run(gqa_job, shape=shape, seed=seed, T=T, tp=tp)
    ranks = [out[r] for r in range(tp)]
    kv, d = shape["num_key_value_heads"], shape["head_dim"]
    W = full_weights(shape, seed)
    for r, o in enumerate(ranks):
        want = r // (tp // kv) if tp >= kv else r  # vLLM: shard tp_rank // num_kv_head_replicas
        assert o["kv_shard"] == want and o["kv_heads"] == max(1, kv // tp), r
        rows = slice(want * o["kv_heads"] * d, (want + 1) * o["kv_heads"] * d)
        assert torch.equal(o["k"], W["k_proj.weight"][rows]) and torch.equal(o["v"], W["v_proj.weight"][rows]), r
        assert o["all_reduces"] == (1 if tp > 1 else 0)
    assert all(torch.equal(o["out"], ranks[0]["out"]) for o in ranks), "a Replicate() output differs between ranks"
    assert rel_err(ranks[0]["out"], transformers_attention(shape, seed, T)) <= 1e-5


@pytest.mark.parametrize("heads, kv, tp, what", [(6, 2, 4, "num_attention_heads"), (8, 4, 3, "num_attention_heads"),
                                                 (24, 8, 12, "the TP degree over num_key_value_heads")])
def test_a_degree_that_does_not_shard_the_heads_is_refused(heads, kv, tp, what):
    shape = AttentionShape(16, heads, kv, 4, 10000.0)
    with pytest.raises(ValueError, match=what):
        GQA(shape, TPGroup(rank=0, size=tp, ranks=tuple(range(tp))), PREFIX, torch.float32)
