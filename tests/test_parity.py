"""Parity with Hugging Face transformers: checkpoints that transformers itself builds and
saves, loaded by tpsim at TP 1, 2 and 4 over real gloo ranks, give transformers'
`output_hidden_states` and logits (float32, relative Frobenius error <= 1e-5).

Position map (transformers' `hidden_states` has L + 1 entries): embed = hidden_states[0],
out(k) = hidden_states[k + 1] for k < L - 1, final = hidden_states[L] (the normed output).

Where transformers and the engines disagree, tpsim follows the engines (SGLang / vLLM), and
the disagreement is a named exception here, excluded from the drawn configs and checked to
still exist (so it is dropped when transformers changes), never a looser tolerance:

- V2_IGNORES_NORM_TOPK_PROB: transformers' DeepseekV2 router never renormalizes the top-k
  weights; SGLang and vLLM do when norm_topk_prob is true. tpsim follows the engines; that
  rule is checked against tests/reference.py in test_properties.py.
- IGNORES_MOE_LAYER_FREQ: transformers makes every layer >= first_k_dense_replace an MoE
  layer; the engines also require layer % moe_layer_freq == 0. So a moe_layer_freq > 1
  checkpoint saved by transformers holds experts where the engines expect a dense MLP, and
  tpsim refuses it by naming the missing dense tensor.
- MSCALE_WITHOUT_MSCALE_ALL_DIM: with YaRN `mscale` set but `mscale_all_dim` absent,
  transformers scales cos/sin by mscale(factor, 1); the engines (and DeepSeek's own code) by
  mscale(factor, mscale). Drawn configs always set both (and often differently).
- V2 has no noaux_tc / sigmoid router in transformers and V3 has only that one, so the
  router method follows model_type in the drawn configs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.config.loader import load_config
from tpsim.base.errors import UsageError
from tpsim.run.jobs import rel_err
from tpsim.testing.jobs import model_job

transformers = pytest.importorskip("transformers", reason="transformers is not installed: "
                                   "pip install -e '.[test]' (CI installs it, so these tests run there)")

transformers.utils.logging.disable_progress_bar()

TOL = 1e-5  # float32: measured worst 7.1e-7 over 300 drawn configs x TP 1, 2, 4 (same math, other order)
TPS = (1, 2, 4)


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    return {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def hf_config(model_type="deepseek_v2", **over) -> dict:
    """A tiny config transformers and tpsim both take; TP 1, 2 and 4 divide it."""
    d = dict(model_type=model_type, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=1000, intermediate_size=64, q_lora_rank=None, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
             routed_scaling_factor=1.0, rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=False,
             n_group=1, topk_group=1, norm_topk_prob=False)
    if model_type == "deepseek_v2":
        d.update(topk_method="greedy", scoring_func="softmax")
    else:
        d.update(topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1)
    d.update(over)
    d["num_key_value_heads"] = d["num_attention_heads"]  # MLA: one latent, every head
    return d


@st.composite
def hf_configs(draw):
    model_type = draw(st.sampled_from(["deepseek_v2", "deepseek_v3"]), label="model_type")
    L = draw(st.integers(2, 4), label="num_hidden_layers")
    over = dict(
        num_hidden_layers=L,
        num_attention_heads=draw(st.sampled_from([4, 8]), label="heads"),
        vocab_size=draw(st.integers(70, 700), label="vocab_size"),
        q_lora_rank=draw(st.sampled_from([None, 24]), label="q_lora_rank"),
        rope_scaling=draw(st.sampled_from([None, yarn(0.707, 0.707), yarn(1.0, 0.5), yarn(0.8, 1.2)]), label="rope"),
        first_k_dense_replace=draw(st.integers(0, min(2, L - 1)), label="first_k_dense_replace"),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.5]), label="routed_scaling_factor"),
        n_shared_experts=draw(st.sampled_from([1, 2]), label="n_shared_experts"),  # transformers needs >= 1
        tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
        num_experts_per_tok=draw(st.integers(1, 3), label="top_k"),
    )
    if model_type == "deepseek_v2":
        method = draw(st.sampled_from(["greedy", "group_limited_greedy"]), label="topk_method")
        over.update(topk_method=method, n_group=1 if method == "greedy" else 4,
                    topk_group=1 if method == "greedy" else draw(st.integers(2, 4), label="topk_group"))
    else:
        over.update(norm_topk_prob=draw(st.booleans(), label="norm_topk_prob"),
                    topk_group=draw(st.integers(1, 2), label="topk_group"))
    return hf_config(model_type, **over)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (transformers' init leaves norms at 1 and the correction bias
    at 0, which would hide a norm or a bias applied to the wrong slice)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            x = torch.randn(t.shape, generator=g)
            if name.endswith("norm.weight"):
                x = 1 + 0.1 * x
            elif name.endswith("e_score_correction_bias"):
                x = 0.05 * x
            elif name.endswith("bias"):  # the GQA families' projection, router and expert biases
                x = 0.1 * x
            elif not name.endswith("embed_tokens.weight"):
                x = x / math.sqrt(t.shape[-1])
            t.copy_(x)


def save_hf(cfg: dict, seed: int, d) -> torch.nn.Module:
    cls = {"deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
           "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[cfg["model_type"]]
    drop = ("model_type", "topk_method", "scoring_func") if cfg["model_type"] == "deepseek_v3" else ("model_type",)
    kwargs = {k: v for k, v in cfg.items() if k not in drop}
    torch.manual_seed(seed)
    model = cls[1](cls[0](**kwargs)).eval()
    randomize(model, seed)
    model.save_pretrained(d)
    return model


def hf_reference(model, ids: list[int]):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def positions_for(L: int) -> list[str]:
    return ["embed", *[f"out({k})" for k in range(L - 1)], "final"]


@settings(max_examples=40)
@given(cfg=hf_configs(), seed=st.integers(0, 2**31 - 1))
@example(cfg=hf_config(num_hidden_layers=4, first_k_dense_replace=2, rope_scaling=yarn(1.0, 0.5),
                       routed_scaling_factor=2.5), seed=1)
@example(cfg=hf_config(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                       tie_word_embeddings=True, vocab_size=77), seed=2)
@example(cfg=hf_config("deepseek_v3", q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5,
                       rope_scaling=yarn(0.707, 0.707)), seed=3)
@example(cfg=hf_config("deepseek_v3", first_k_dense_replace=0, norm_topk_prob=False, rope_scaling=yarn(0.8, 1.2),
                       n_shared_experts=2), seed=4)
def test_tpsim_equals_transformers(rank_pool, tmp_path_factory, cfg, seed):
    check_parity(rank_pool, tmp_path_factory.mktemp("hf"), cfg, seed, TPS)


def check_parity(rank_pool, d, cfg: dict, seed: int, degrees, save=None) -> None:
    """transformers' model of `cfg` (seeded `seed`, saved in `d` by `save`, default this file's
    DeepSeek `save_hf`) and tpsim reading that checkpoint at each TP degree: every hidden state and
    the logits within TOL, every rank the same capture."""
    model = (save or save_hf)(cfg, seed, d)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg["vocab_size"], (11,), generator=g).tolist()
    hidden, logits = hf_reference(model, ids)
    L, H, kind = cfg["num_hidden_layers"], cfg["hidden_size"], cfg.get("model_type", "deepseek_v2")
    positions = positions_for(L)
    loaded = load_config(d)
    assert loaded.model_type == kind
    for tp in degrees:
        out = rank_pool.run(model_job, cfg=loaded.to_dict(), seed=0, dtype="float32", input_ids=ids,
                            positions=positions, tp=tp, checkpoint=str(d))
        cap = out[0]["capture"]
        for i, pos in enumerate(positions):
            err = rel_err(cap[:, i * H:(i + 1) * H], hidden[i])
            assert err <= TOL, f"{kind} TP={tp} {pos} vs hidden_states[{i}]: rel err {err:.2e}"
        err = rel_err(out[0]["logits"], logits)
        assert err <= TOL, f"{kind} TP={tp} logits: rel err {err:.2e}"
        for r in range(1, tp):  # every rank of the group computed the same capture
            assert torch.equal(out[r]["capture"], cap), f"{kind} TP={tp} rank {r} differs from rank 0"


# --- the named exceptions still exist -------------------------------------------------------------

def test_exception_v2_ignores_norm_topk_prob(rank_pool, tmp_path):
    """V2_IGNORES_NORM_TOPK_PROB: with it on, tpsim (renormalizing, as the engines) differs from
    transformers; with it off they agree (test above). Remove the exception when this fails."""
    cfg = hf_config(norm_topk_prob=True, num_experts_per_tok=3)
    model = save_hf(cfg, 5, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["norm_topk_prob"] is True
    ids = list(range(1, 12))
    hidden, _ = hf_reference(model, ids)
    out = rank_pool.run(model_job, cfg=load_config(tmp_path).to_dict(), seed=0,
                        dtype="float32", input_ids=ids, positions=["final"], tp=1, checkpoint=str(tmp_path))
    assert rel_err(out[0]["capture"], hidden[-1]) > 1e-3


def test_exception_moe_layer_freq(tmp_path):
    """IGNORES_MOE_LAYER_FREQ: transformers saves experts in layer 1 of a moe_layer_freq=2
    model; the engines (and tpsim) expect a dense MLP there, and tpsim says which tensor."""
    from tpsim.weights.reader import Checkpoint, validate
    save_hf(hf_config(moe_layer_freq=2, first_k_dense_replace=0), 6, tmp_path)
    with pytest.raises(UsageError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight is missing"):
        validate(Checkpoint(tmp_path), load_config(tmp_path))


def test_exception_mscale_without_mscale_all_dim():
    """MSCALE_WITHOUT_MSCALE_ALL_DIM: transformers' cos/sin factor differs from the engines'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tpsim.layers.rope import DeepseekRotaryEmbedding
    rs = {k: v for k, v in yarn(0.8, 0).items() if k != "mscale_all_dim"}
    hf = transformers.DeepseekV2Config(**hf_config(rope_scaling=rs))
    _, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = DeepseekRotaryEmbedding(8, 10000.0, rs, torch.device("cpu")).mscale
    assert ours == pytest.approx(0.1 * 0.8 * math.log(4.0) + 1)  # engines: mscale(factor, mscale) / 1
    assert abs(hf_factor - ours) > 1e-3


def test_cli_capture_of_a_transformers_checkpoint_at_tp4(tmp_path):
    """The issue's end-to-end statement: `tpsim capture --model <dir saved by transformers>
    --tp 4` writes the aux hidden states transformers' output_hidden_states gives."""
    from safetensors import safe_open

    from clirun import run_cli
    cfg = hf_config("deepseek_v3", q_lora_rank=24, norm_topk_prob=True, routed_scaling_factor=2.5,
                    rope_scaling=yarn(1.0, 0.707), vocab_size=333)
    model = save_hf(cfg, 9, tmp_path / "hf")
    ids = [5, 17, 2, 300, 41, 9, 77, 128, 6]
    hidden, _ = hf_reference(model, ids)
    out = tmp_path / "cap.safetensors"
    r = run_cli("capture", "--model", tmp_path / "hf", "--tp", "4", "--convention", "hf-ids", "--layers", "0,2,3",
                "--tokens", ",".join(map(str, ids)), "--out", out)
    assert r.returncode == 0, r
    with safe_open(str(out), "pt") as f:
        cap = f.get_tensor("aux_hidden_states")
        assert f.get_tensor("input_ids").tolist() == ids
    H = cfg["hidden_size"]
    assert cap.shape == (len(ids), 3 * H)
    for slot, index in enumerate([0, 2, 3]):
        assert rel_err(cap[:, slot * H:(slot + 1) * H], hidden[index]) <= TOL


@pytest.mark.parametrize("over", [[], ["model_type=deepseek_v3", "topk_method=noaux_tc", "scoring_func=sigmoid",
                                       "q_lora_rank=16", "norm_topk_prob=true", "routed_scaling_factor=2.5"]],
                         ids=["tiny-v2", "tiny-as-v3"])
def test_transformers_loads_an_export(tmp_path, over):
    """`tpsim export` writes what transformers' from_pretrained reads, and transformers then
    computes tpsim's seeded model (TP=1 in process; the TP degrees agree by the main property)."""
    from tpsim.capture import Position
    from tpsim.weights.export import export_checkpoint
    from tpsim.config.loader import with_overrides
    from tpsim.run.jobs import build_model, run_captured
    from tpsim.parallel import TPGroup
    from pathlib import Path
    cfg = with_overrides(load_config(Path(__file__).resolve().parents[1] / "configs/tiny.yaml"),
                         ["num_hidden_layers=3", *over])
    export_checkpoint(cfg, 11, tmp_path / "x", "float32", 10**9)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "x", dtype=torch.float32).eval()
    assert type(model).__name__ == {"deepseek_v2": "DeepseekV2ForCausalLM",
                                    "deepseek_v3": "DeepseekV3ForCausalLM"}[cfg.model_type]
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    hidden, logits = hf_reference(model, ids)
    positions = positions_for(3)
    cap, ours = run_captured(build_model(cfg, TPGroup(), 11, "float32"), ids,
                             [Position.parse(p, 3) for p in positions])
    H = cfg.hidden_size
    for i, pos in enumerate(positions):
        assert rel_err(cap[:, i * H:(i + 1) * H], hidden[i]) <= TOL, pos
    assert rel_err(ours, logits) <= TOL
