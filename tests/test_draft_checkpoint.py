"""Reading a draft in SpecForge's layout: a clean one reads with no finding and runs; each planted defect
(fc width, d2t/t2d, embed_tokens dropped, a key no loader reads, a missing key) is found, typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tpsim.draft.attention import DraftCache
from tpsim.draft.checkpoint import build, inspect, read
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.weights import specs

CONFIG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
          "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
          "vocab_size": 40, "draft_vocab_size": 12}


def clean_tensors(cfg: DraftConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(cfg)
    out = {name: torch.randn(spec.shape, generator=g) / 4 for name, spec in specs(model).items()}
    used = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
    out["d2t"] = used - torch.arange(cfg.draft_vocab_size)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    out["t2d"] = t2d
    return out


def write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def clean(tmp_path):
    cfg = DraftConfig.from_json(CONFIG)
    return cfg, clean_tensors(cfg)


def defects(path, **kw) -> list[DraftDefect]:
    return [f.defect for f in inspect(path, **kw)]


def test_clean_draft_reads_and_runs(tmp_path, clean):
    cfg, tensors = clean
    folder = write(tmp_path / "d", CONFIG, tensors)
    assert inspect(folder) == []
    assert inspect(folder / "config.json") == []
    model = build(read(folder))
    assert torch.equal(model.fc.weight, tensors["fc.weight"])
    step = model.first(torch.randn(5, cfg.capture_width), torch.arange(5), torch.arange(5), DraftCache())
    ids = model.proposals(step)
    assert bool(torch.isin(ids, torch.nonzero(tensors["t2d"]).flatten()).all())
    full = model.target_logits(step.logits)
    assert torch.equal(full.argmax(-1), ids)


def test_fc_width_against_target_hidden(tmp_path, clean):
    _, tensors = clean
    tensors["fc.weight"] = torch.randn(16, 2 * 16)  # trained on two captures
    found = inspect(write(tmp_path / "d", CONFIG, tensors))
    assert [f.defect for f in found] == [DraftDefect.FC_WIDTH]
    assert "fits 2 captures" in found[0].cause and found[0].source and found[0].fix
    # the target's hidden size given: a 3-capture fc of the draft's own width is wrong for a 20-wide target
    _, ok = clean[0], clean_tensors(clean[0])
    assert defects(write(tmp_path / "e", CONFIG, ok), target_hidden=20) == [DraftDefect.FC_WIDTH]


def test_fc_width_against_the_ids_count(tmp_path, clean):
    _, tensors = clean
    config = {**CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9, 13],
                                         "use_aux_hidden_state": True}}
    found = inspect(write(tmp_path / "d", config, tensors))
    assert DraftDefect.FC_WIDTH in [f.defect for f in found]
    assert "4 aux layer ids" in next(f for f in found if f.defect is DraftDefect.FC_WIDTH).cause


@pytest.mark.parametrize("plant", ["d2t-out-of-vocab", "d2t-duplicate", "t2d-disagrees", "t2d-wrong-length",
                                   "d2t-wrong-length"])
def test_vocab_map_defects(tmp_path, clean, plant):
    _, tensors = clean
    d2t, t2d = tensors["d2t"].clone(), tensors["t2d"].clone()
    if plant == "d2t-out-of-vocab":
        d2t[-1] = 10_000
    elif plant == "d2t-duplicate":
        d2t[1] = d2t[0] - 1  # draft id 1 maps to draft id 0's target
    elif plant == "t2d-disagrees":
        t2d[~t2d.clone()] = True  # every id marked: more than d2t maps to
    elif plant == "t2d-wrong-length":
        t2d = t2d[:-1]
    else:
        d2t = d2t[:-1]
    tensors.update(d2t=d2t, t2d=t2d)
    assert defects(write(tmp_path / "d", CONFIG, tensors)) == [DraftDefect.VOCAB_MAP]


def test_embed_tokens_dropped_as_by_the_sglang_export(tmp_path, clean):
    _, tensors = clean
    tensors = {k: v for k, v in tensors.items() if "embed" not in k}
    found = inspect(write(tmp_path / "d", CONFIG, tensors))
    assert [f.defect for f in found] == [DraftDefect.EMBED_ABSENT]
    assert "to_sglang" in found[0].source and "embedding-source" in found[0].fix
    with pytest.raises(ValueError, match="embed_tokens"):
        build(read(tmp_path / "d"))
    target_embed = torch.randn(40, 16)
    assert torch.equal(build(read(tmp_path / "d"), embed=target_embed).embed_tokens.weight[:40], target_embed)


def test_key_no_loader_reads(tmp_path, clean):
    _, tensors = clean
    tensors["midlayer.self_attn.qkv_proj.weight"] = torch.zeros(3)
    tensors["fc_norm.0.weight"] = torch.ones(16)  # fc_norm weights without `fc_norm: true` in the config
    found = inspect(write(tmp_path / "d", CONFIG, tensors))
    assert [(f.defect, f.key) for f in found] == [(DraftDefect.IGNORED_KEY, "fc_norm.0.weight"),
                                                  (DraftDefect.IGNORED_KEY, "midlayer.self_attn.qkv_proj.weight")]


def test_missing_and_misshapen_keys(tmp_path, clean):
    _, tensors = clean
    del tensors["norm.weight"], tensors["d2t"]
    tensors["lm_head.weight"] = torch.zeros(11, 16)
    found = inspect(write(tmp_path / "d", {**CONFIG, "fc_norm": True}, tensors))
    got = sorted((f.defect.value, f.key) for f in found)
    assert got == sorted([("missing-key", "norm.weight"), ("missing-key", "d2t"), ("shape", "lm_head.weight"),
                          *(("missing-key", f"fc_norm.{i}.weight") for i in range(3))])
    assert all(f.cause and f.source and f.fix and f.line() for f in found)


def test_the_speculators_layout_reads_as_specforges(tmp_path, clean):
    """The same draft written in the speculators format vLLM reads (the layer's config nested in
    transformer_layer_config, its tensors as layers.0.*; speculators 0.9.0's save_pretrained, which
    tests/test_draft_parity.py reads where speculators is installed) reads to the same config and tensors."""
    from tpsim.draft.config import Layout
    cfg, tensors = clean
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "vocab_size", "num_hidden_layers", "model_type")
    nested = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size": 12,
              "target_hidden_size": None, "norm_before_fc": False, "eagle_aux_hidden_state_layer_ids": None,
              "speculators_config": {"algorithm": "eagle3", "verifier": {"architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": {**{k: CONFIG[k] for k in layer_keys if k in CONFIG},
                                           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}}
    spec = write(tmp_path / "spec", nested, {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()})
    flat = read(write(tmp_path / "flat", CONFIG, tensors))
    got = read(spec)
    assert got.layout is Layout.SPECULATORS and flat.layout is Layout.SPECFORGE
    assert got.config == flat.config == cfg
    assert got.tensors.keys() == flat.tensors.keys() and all(torch.equal(got.tensors[k], v) for k, v in flat.tensors.items())
    assert inspect(spec) == []


def test_the_eagle_repositorys_layout_reads_as_specforges(tmp_path, clean):
    """EAGLE's drafts: SpecForge's keys in a pytorch_model.bin (its EaModel.from_pretrained torch.loads it), read
    with weights_only; a pickle that is not a state dict of tensors is one line, exit 2 from the CLI."""
    from clirun import assert_one_line_error, run_cli
    from tpsim.draft.config import Layout
    cfg, tensors = clean
    folder = tmp_path / "eagle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    torch.save(tensors, folder / "pytorch_model.bin")
    got, flat = read(folder), read(write(tmp_path / "flat", CONFIG, tensors))
    assert got.layout is Layout.EAGLE and got.config == flat.config
    assert got.tensors.keys() == flat.tensors.keys() and all(torch.equal(got.tensors[k], v) for k, v in flat.tensors.items())
    torch.save({"step": 3}, folder / "pytorch_model.bin")
    assert_one_line_error(run_cli("draft", str(folder)), "is not a readable state dict")
