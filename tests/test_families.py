"""Parity with transformers for the GQA families (Llama 3, Qwen3, Qwen3-MoE): checkpoints that
transformers builds and saves with `save_pretrained`, loaded by tpsim at TP 1, 2, 4 and 8 over
real gloo ranks, give transformers' `output_hidden_states` and logits (float32, relative
Frobenius error <= 1e-5). Position map as in test_parity.py: embed = hidden_states[0],
out(k) = hidden_states[k + 1] for k < L - 1, final = hidden_states[L].

The drawn shapes put num_key_value_heads below 8, so TP 8 (and often 4) replicates KV heads;
Llama draws tied and untied embeddings, llama3 rope scaling and attention biases (q/k/v and
o_proj); Qwen3 draws YaRN; Qwen3-MoE draws norm_topk_prob, decoder_sparse_step and
mlp_only_layers; GPT-OSS draws the sliding window (shorter and longer than the sequence), the
layer types, the SwiGLU clamp, and its MXFP4 experts are read per slice. Kimi-K2 is DeepSeek-V3's model file with its own shape: its published
config loads, and test_parity covers the architecture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from test_parity import check_parity, hf_reference, positions_for, randomize
from tpsim.config.loader import load_config
from tpsim.run.jobs import rel_err
from tpsim.testing.jobs import model_job

transformers = pytest.importorskip("transformers", reason="transformers is not installed: "
                                   "pip install -e '.[test]' (CI installs it, so these tests run there)")
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5
TPS = (1, 2, 4, 8)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # short: 11 positions cross every band
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
YARN_GPT_OSS = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 8}


def hf_config(model_type: str = "llama", **over) -> dict:
    """A tiny config of `model_type` that TP 1, 2, 4 and 8 all shard (8 query heads, KV heads split
    or replicated)."""
    d = dict(model_type=model_type, hidden_size=32, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=500, intermediate_size=64, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0, rope_scaling=None)
    if model_type != "llama":
        d.update(head_dim=8)
    if model_type == "qwen3_moe":
        d.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "gpt_oss":  # experts of intermediate_size; sliding window 3 < the 11 tokens
        d.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, attention_bias=True,
                 sliding_window=3, rope_scaling=YARN_GPT_OSS, swiglu_limit=7.0)
    d.update(over)
    if model_type == "gpt_oss" and "layer_types" not in over:
        d["layer_types"] = [("sliding_attention", "full_attention")[k % 2] for k in range(d["num_hidden_layers"])]
    return d


@st.composite
def hf_configs(draw):
    model_type = draw(st.sampled_from(sorted(CLASSES)), label="model_type")
    L = draw(st.integers(2, 4), label="num_hidden_layers")
    over = dict(num_hidden_layers=L, num_key_value_heads=draw(st.sampled_from([1, 2, 4, 8]), label="kv_heads"),
                vocab_size=draw(st.integers(70, 700), label="vocab_size"),
                tie_word_embeddings=draw(st.booleans(), label="tie_word_embeddings"),
                rope_theta=draw(st.sampled_from([10000.0, 500000.0]), label="rope_theta"))
    if model_type == "llama":
        over.update(rope_scaling=draw(st.sampled_from([None, LLAMA3]), label="rope"),
                    attention_bias=draw(st.booleans(), label="attention_bias"))
    elif model_type == "gpt_oss":
        over.update(head_dim=draw(st.sampled_from([4, 8, 16]), label="head_dim"),
                    sliding_window=draw(st.integers(1, 12), label="sliding_window"),
                    layer_types=draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                              min_size=L, max_size=L), label="layer_types"),
                    num_experts_per_tok=draw(st.integers(1, 3), label="top_k"),
                    swiglu_limit=draw(st.sampled_from([7.0, 0.5]), label="swiglu_limit"))
    else:
        over.update(rope_scaling=draw(st.sampled_from([None, YARN]), label="rope"),
                    head_dim=draw(st.sampled_from([4, 8, 16]), label="head_dim"))
    if model_type == "qwen3_moe":
        over.update(norm_topk_prob=draw(st.booleans(), label="norm_topk_prob"),
                    num_experts_per_tok=draw(st.integers(1, 3), label="top_k"),
                    decoder_sparse_step=draw(st.integers(1, 2), label="decoder_sparse_step"),
                    mlp_only_layers=draw(st.lists(st.integers(0, L - 1), max_size=2, unique=True),
                                         label="mlp_only_layers"))
    return hf_config(model_type, **over)


def hf_kwargs(cfg: dict) -> dict:
    """transformers >= 5 takes rope_theta and the scaling as `rope_parameters`."""
    kw = {k: v for k, v in cfg.items() if k not in ("model_type", "rope_theta", "rope_scaling")}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]} if cfg["rope_scaling"] is None \
        else {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}
    return kw


def save_hf(cfg: dict, seed: int, d: Path) -> torch.nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[cfg["model_type"]])
    torch.manual_seed(seed)
    # GPT-OSS's sinks: transformers' eager attention (its sdpa path has none)
    attn = "eager" if cfg["model_type"] == "gpt_oss" else "sdpa"
    model = model_cls._from_config(config_cls(**hf_kwargs(cfg)), attn_implementation=attn).eval()
    randomize(model, seed)
    model.save_pretrained(d)
    return model


def degrees(cfg: dict) -> list[int]:
    """The TP degrees the heads allow: tp divides the query heads, and the KV heads split or replicate."""
    kv = cfg["num_key_value_heads"]
    return [tp for tp in TPS if cfg["num_attention_heads"] % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


@settings(max_examples=12)
@given(cfg=hf_configs(), seed=st.integers(0, 2**31 - 1))
@example(cfg=hf_config("llama", num_key_value_heads=2, rope_scaling=LLAMA3, attention_bias=True,
                       tie_word_embeddings=True), seed=1)
@example(cfg=hf_config("qwen3", num_key_value_heads=1, rope_scaling=YARN, head_dim=16), seed=2)
@example(cfg=hf_config("qwen3_moe", num_hidden_layers=4, num_key_value_heads=4, decoder_sparse_step=2,
                       mlp_only_layers=[3], norm_topk_prob=False, num_experts_per_tok=3), seed=3)
@example(cfg=hf_config("gpt_oss", num_key_value_heads=1, swiglu_limit=0.5, tie_word_embeddings=True), seed=4)
def test_tpsim_equals_transformers(rank_pool, tmp_path_factory, cfg, seed):
    check_parity(rank_pool, tmp_path_factory.mktemp("hf"), cfg, seed, degrees(cfg), save=save_hf)


def test_every_family_has_a_degree_that_replicates_kv_heads():
    """The strategy reaches KV replication (tp > num_key_value_heads) for each family."""
    for model_type in CLASSES:
        assert any(tp > 2 for tp in degrees(hf_config(model_type)))


@pytest.mark.parametrize("name,model_type,layers,moe", [
    ("llama-3.1-8b", "llama", 32, 0), ("llama-3.3-70b", "llama", 80, 0), ("qwen3-8b", "qwen3", 36, 0),
    ("qwen3-30b-a3b", "qwen3_moe", 48, 48), ("qwen3-235b-a22b", "qwen3_moe", 94, 94),
    ("kimi-k2", "kimi_k2", 61, 60), ("gpt-oss-20b", "gpt_oss", 24, 24), ("gpt-oss-120b", "gpt_oss", 36, 36)])
def test_builtin_configs_load_with_their_published_shape(name, model_type, layers, moe):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.moe_layer_count()) == (model_type, layers, moe)
    for tp in (1, 2, 4, 8):
        cfg.check_tp(tp)


TINY_FAMILIES = ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss"]


@pytest.mark.parametrize("name", TINY_FAMILIES)
def test_transformers_loads_an_export(tmp_path, name):
    """`tpsim export` of each family writes what transformers' from_pretrained reads (Qwen3-MoE's
    `num_experts` by the Hub's name), and transformers then computes tpsim's seeded model."""
    from tpsim.capture import Position
    from tpsim.weights.export import export_checkpoint
    from tpsim.config.loader import with_overrides
    from tpsim.parallel import TPGroup
    from tpsim.run.jobs import build_model, run_captured
    cfg = with_overrides(load_config(CONFIGS / f"{name}.yaml"), ["num_hidden_layers=3"])
    export_checkpoint(cfg, 11, tmp_path / "x", "float32", 10**9)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "x", dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert type(model).__name__ == cfg.family.model_types[cfg.model_type]
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    hidden, logits = hf_reference(model, ids)
    positions = positions_for(3)
    cap, ours = run_captured(build_model(cfg, TPGroup(), 11, "float32"), ids, [Position.parse(p, 3) for p in positions])
    H = cfg.hidden_size
    for i, pos in enumerate(positions):
        assert rel_err(cap[:, i * H:(i + 1) * H], hidden[i]) <= TOL, pos
    assert rel_err(ours, logits) <= TOL


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_bench_builds_transformers_beside_tpsim(name):
    """benchmarks/forward.py's pairing (tpsim.bench.hf.build_models) holds for the GQA families:
    the same seeded weights in both, the same logits."""
    from tpsim.bench.hf import build_models
    from tpsim.config.loader import with_overrides
    cfg = with_overrides(load_config(CONFIGS / f"{name}.yaml"), ["num_hidden_layers=2"])
    ours, hf = build_models(cfg, 5, "float32", torch.device("cpu"))
    ids = torch.tensor([7, 3, 99, 1, 0, 42])
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids[None]).logits[0]) <= TOL


@pytest.mark.parametrize("name", TINY_FAMILIES)
def test_every_command_runs_on_each_family(tmp_path, name):
    """check at TP 1/2/4/8, capture, named points + diagnose, explain, align, export and triage on a
    model of each family, from the command line (exit codes and the line that says it worked)."""
    from clirun import ROOT, run_clis
    run, ref = tmp_path / "run.safetensors", tmp_path / "ref.safetensors"
    points = "embed.out,layers.3.attn.o_proj.partial,layers.3.out"
    argvs = {
        "check": ["check", "--model", name, "--tp", "1,2,4,8"],
        "capture": ["capture", "--model", name, "--tp", "4", "--out", tmp_path / "cap.safetensors"],
        "run": ["capture", "--model", name, "--tp", "2", "--points", points, "--seq-len", "8", "--out", run],
        "ref": ["capture", "--model", name, "--tp", "1", "--points", points, "--seq-len", "8", "--out", ref],
        "explain": ["explain", "--model", name, "--tp", "8"],
        "align": ["align", "--train", "specforge-ids:1,3,5", "--serve", "vllm-ids:2,4,6", "--model", name, "--tp", "2"],
        "export": ["export", "--model", name, "--out", tmp_path / "ckpt"],
        "triage": ["triage", "--draft-config", ROOT / "configs/drafts/ids-at-top-level.json", "--server",
                   "sglang@0.5.6", "--tp", "4", "--model", name],
    }
    if name in ("tiny-qwen3-moe", "tiny-gpt-oss"):
        argvs["ep"] = ["check", "--model", name, "--mode", "ep", "--tp", "2,4,8"]
    r = run_clis(argvs)
    for key in argvs:
        if key != "triage":
            assert r[key].returncode == 0, r[key]
    assert "PASS" in r["check"].stdout and "PASS" in r.get("ep", r["check"]).stdout
    assert "KV heads" in r["explain"].stdout and "o_proj.partial" in r["explain"].stdout
    assert "ALIGNED" in r["align"].stdout
    assert r["triage"].returncode == 1 and "eagle_config" in r["triage"].stdout  # the built-in case: ids at top level
    d = run_clis({"diagnose": ["diagnose", tmp_path / "run.rank0.safetensors", tmp_path / "run.rank1.safetensors",
                               "--reference", tmp_path / "ref.rank0.safetensors"],
                  "reload": ["check", "--model", tmp_path / "ckpt", "--tp", "1,2"]})
    assert d["diagnose"].returncode == 1 and "Partial" in d["diagnose"].stdout, d["diagnose"]  # o_proj.partial found
    assert d["reload"].returncode == 0 and "checkpoint" in d["reload"].stdout, d["reload"]


def test_gpt_oss_mxfp4_checkpoint_reads_as_its_dequantized_weights(rank_pool, tmp_path):
    """A GPT-OSS checkpoint whose experts are MXFP4 (`_blocks` / `_scales`, quantization_config
    mxfp4, as openai/gpt-oss publishes them) gives at TP 1, 2 and 4 exactly what the same model
    with those experts dequantized gives: each rank reads its slice of the blocks."""
    import json

    from safetensors.torch import load_file, save_file

    from tpsim.weights.export import export_checkpoint
    from tpsim.weights.mxfp4 import dequantize, quantize
    from tpsim.config.loader import with_overrides
    cfg = with_overrides(load_config(CONFIGS / "tiny-gpt-oss.yaml"), ["num_hidden_layers=2"])
    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    export_checkpoint(cfg, 3, plain, "float32", 10**9)
    tensors = load_file(str(plain / "model.safetensors"))
    quantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize(tensors[name])
        tensors[name] = dequantize(blocks, scales)  # the plain model holds the rounded weights
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(plain / "model.safetensors"))
    packed.mkdir()
    save_file({**{n: t for n, t in tensors.items() if not n.endswith(("gate_up_proj", "down_proj"))}, **quantized},
              str(packed / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    (packed / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    ids, positions = [5, 9, 1, 200, 3, 77, 8], ["out(0)", "final"]
    for tp in (1, 2, 4):
        a, b = (rank_pool.run(model_job, cfg=load_config(d).to_dict(), seed=0, dtype="float32", input_ids=ids,
                              positions=positions, tp=tp, checkpoint=str(d)) for d in (plain, packed))
        assert torch.equal(a[0]["capture"], b[0]["capture"]) and torch.equal(a[0]["logits"], b[0]["logits"]), tp
