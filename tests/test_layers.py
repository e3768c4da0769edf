"""Each TP layer, on real gloo ranks, equals its un-sharded reference computed from the full
weights (the embedding bit for bit), for drawn configs and TP degrees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from strategies import TP_DEGREES, config_dicts
from tpsim.config.loader import config_from_dict
from tpsim.run.jobs import rel_err
from tpsim.parallel import TPGroup
from tpsim.testing.jobs import embedding_ids, layer_input, make_layer
from tpsim.weights.seeded import init_tensor, weight_specs
from tpsim.testing.jobs import layer_job

# kind -> (placement of the output on each rank, collectives per forward at tp > 1)
KINDS = {"embedding": ("replicate", 1), "lm_head": ("replicate", 0), "column": ("shard", 0),
         "merged": ("shard", 0), "row": ("replicate", 1), "mlp": ("replicate", 1), "mla": ("replicate", 1),
         "moe": ("replicate", 1)}


def full(cfg, kind, seed):
    layer = make_layer(kind, cfg, TPGroup(), torch.float32)
    return {s.name: init_tensor(seed, s.name, s.shape) for s in weight_specs(layer)}


def expected(kind, cfg, seed, T, tp):
    W = full(cfg, kind, seed)
    if kind == "embedding":  # the ids at every rank's vocab slice edges too
        return F.embedding(embedding_ids(cfg, seed, T, tp), W["model.embed_tokens.weight"])
    width = cfg.intermediate_size if kind == "row" else cfg.hidden_size
    x = layer_input(seed, (T, width), torch.float32)
    if kind == "lm_head":
        return x @ W["lm_head.weight"].T
    if kind in ("column", "row"):
        return x @ W[f"{kind[:3]}.weight"].T + W[f"{kind[:3]}.bias"]
    if kind == "merged":
        return x @ W["mlp.gate_proj.weight"].T, x @ W["mlp.up_proj.weight"].T
    if kind == "mlp":
        return R.swiglu(W, "model.layers.0.mlp.", x)
    if kind == "mla":
        return R.attention(cfg, W, "model.layers.0.self_attn.", x)
    return R.moe(cfg, W, "model.layers.0.mlp.", x)


@st.composite
def layer_cases(draw, kind):
    tp = draw(st.sampled_from(TP_DEGREES), label="tp")
    cfg = draw(config_dicts(tp, max_layers=1, moe=(kind == "moe"), families=("deepseek_v2",)))  # tests/reference.py
    # is DeepSeek's textbook; GQA has tests/test_gqa.py
    if kind == "moe":
        cfg["first_k_dense_replace"] = 0
    return tp, cfg, draw(st.integers(0, 2**31 - 1), label="seed"), draw(st.integers(1, 9), label="T")


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=15)
@given(data=st.data())
def test_tp_layer_equals_unsharded_reference(rank_pool, kind, data):
    tp, cfg_d, seed, T = data.draw(layer_cases(kind))
    cfg = config_from_dict(cfg_d)
    out = rank_pool.run(layer_job, kind=kind, cfg=cfg_d, seed=seed, dtype="float32", T=T, tp=tp)
    outs = [out[r]["out"] for r in range(tp)]
    placement, n_collectives = KINDS[kind]
    ref = expected(kind, cfg, seed, T, tp)
    if kind == "merged":  # rank r: [gate rows of r ; up rows of r], each logical matrix split separately
        gate, up = ref
        ref = torch.cat([torch.cat([g, u], -1) for g, u in zip(gate.chunk(tp, -1), up.chunk(tp, -1))], -1)
    if placement == "shard":
        for r, o in enumerate(outs):
            assert rel_err(o, ref.chunk(tp, -1)[r]) <= 1e-6, f"rank {r}"
    else:
        assert all(torch.equal(o, outs[0]) for o in outs), "a Replicate() output differs between ranks"
        if kind == "embedding":  # masked rows are exact zeros, so the all-reduce is exact
            assert torch.equal(outs[0], ref)
        else:
            assert rel_err(outs[0], ref) <= 1e-5
    if kind == "lm_head":
        assert outs[0].shape[-1] == cfg.vocab_size  # padding sliced off after the all-gather
        assert all(out[r]["all_gathers"] == (1 if tp > 1 else 0) for r in range(tp))
    else:
        assert all(out[r]["all_reduces"] == (n_collectives if tp > 1 else 0) for r in range(tp))


def test_padded_embedding_rows_are_zero():
    """vocab 1010 at TP=2 (SGLang's docstring example): padded to 1024, rank 1 holds 512..1009
    then 14 zero rows."""
    cfg = config_from_dict({**_small(), "vocab_size": 1010})
    from tpsim.layers import VocabParallelEmbedding
    layer = VocabParallelEmbedding(1010, cfg.hidden_size, TPGroup(rank=1, size=2, ranks=(0, 1)), "e", torch.float32)
    for s in layer.weight_specs():
        s.load(init_tensor(0, s.name, s.shape))
    assert (layer.start, layer.end) == (512, 1024)
    assert torch.equal(layer.weight[:498], init_tensor(0, "e.weight", (1010, cfg.hidden_size))[512:])
    assert not layer.weight[498:].any()


def _small():
    return {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 100,
            "intermediate_size": 16, "q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4, "v_head_dim": 4}


def test_weights_identical_at_every_tp():
    """Master weight then split: concatenating the shards of every TP degree gives the TP=1 weight."""
    cfg = config_from_dict(_small())
    from tpsim.run.jobs import build_model
    ref = {n: p for n, p in build_model(cfg, TPGroup(), 7, "float32").named_parameters()}
    for tp in (2,):
        shards = [dict(build_model(cfg, TPGroup(rank=r, size=tp, ranks=tuple(range(tp))), 7, "float32")
                       .named_parameters()) for r in range(tp)]
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(torch.cat([s[o] for s in shards], 1), ref[o])
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(torch.cat([s[q] for s in shards], 0), ref[q])
        n = "model.layers.0.input_layernorm.weight"
        assert all(torch.equal(s[n], ref[n]) for s in shards)


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 64), shift=st.integers(1, 5000), yarn=st.booleans(), neox=st.booleans())
def test_rope_tables_are_shared_only_for_the_same_positions(T, shift, yarn, neox):
    """RopeTable.cos_sin (DeepSeek's interleaved and NeoX's halves): two layers with the same settings
    share the table of one positions tensor; other positions (even of equal shape) get their own,
    equal to a table computed from scratch; the two styles never share one."""
    from tpsim.layers.rope import DeepseekRotaryEmbedding, NeoxRotaryEmbedding, RopeTable
    scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707} if yarn else None
    kind, other = (NeoxRotaryEmbedding, DeepseekRotaryEmbedding) if neox else (DeepseekRotaryEmbedding,
                                                                                NeoxRotaryEmbedding)
    a, b = (kind(16, 10000.0, scaling, torch.device("cpu")) for _ in range(2))
    p = torch.arange(T)
    first = a.cos_sin(p)
    assert all(x is y for x, y in zip(first, b.cos_sin(p)))  # computed once for both layers
    assert not any(x is y for x, y in zip(first, other(16, 10000.0, scaling, torch.device("cpu")).cos_sin(p)))
    q = p + shift
    moved = b.cos_sin(q)
    RopeTable._tables.clear()
    fresh = kind(16, 10000.0, scaling, torch.device("cpu")).cos_sin(q)
    assert all(torch.equal(x, y) for x, y in zip(moved, fresh))
    assert not torch.equal(moved[0], first[0])
