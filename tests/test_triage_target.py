"""triage's target: taken from the draft (its width and vocabulary) or from --model and checked against
the draft; a target too big to run here replayed on a stand-in that keeps what decides a finding; and
the story of issue 35 (a DeepSeek-V3 draft whose ids were edited after training) answered in one command
with fixes that triage replayed."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from tpsim.app.target import STAND_IN_ABOVE, target_for
from tpsim.base.errors import UsageError
from tpsim.config.loader import BUILTIN_CONFIGS, builtin_names, load_config
from tpsim.config.standin import stand_in
from tpsim.model.decoder import shard_bytes
from tpsim.offline.align import DraftConfig

V3_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
            "num_hidden_layers": 1, "vocab_size": 129280, "draft_vocab_size": 32000,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 2, 30]}}


def draft(raw: dict) -> DraftConfig:
    eagle = raw.get("eagle_config") or {}
    return DraftConfig("draft/config.json", eagle.get("eagle_aux_hidden_state_layer_ids"),
                       raw.get("eagle_aux_hidden_state_layer_ids"), raw)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(builtin_names()), st.sampled_from([1, 2, 4, 8]))
def test_a_stand_in_keeps_what_decides_a_finding(name, tp):
    real = load_config(BUILTIN_CONFIGS / f"{name}.yaml")
    small = stand_in(real, tp).cfg
    L = real.num_hidden_layers
    assert (small.model_type, small.num_hidden_layers, small.layer_types) == (real.model_type, L, real.layer_types)
    assert [small.is_moe_layer(k) for k in range(L)] == [real.is_moe_layer(k) for k in range(L)]
    assert [small.window(k) is None for k in range(L)] == [real.window(k) is None for k in range(L)]
    if not real.mla:  # KV heads split at this degree, or replicated, as the real model's are
        assert (small.kv_heads % tp == 0) == (real.kv_heads % tp == 0)
    assert (small.topk_method, small.scoring_func, small.n_group) == (real.topk_method, real.scoring_func, real.n_group)
    for t in {1, tp}:
        small.check_tp(t)
    assert shard_bytes(small, 1, torch.float32) <= STAND_IN_ABOVE


def test_the_draft_names_its_target_and_a_too_big_target_gets_a_stand_in():
    t = target_for(draft(V3_DRAFT), None, [], 8)
    assert t.name == "deepseek-v3" and t.real.hidden_size == 7168 and t.source.cfg.hidden_size == 64
    assert "hidden_size 7168 and vocab_size 129280" in t.chosen
    assert t.standin.line(t.name, 8).startswith("deepseek-v3 is replayed on a stand-in: its 61 layers (3 dense, "
                                                 "58 MoE), model file, numbering and TP=8 kept; hidden_size 7168 -> 64")


@pytest.mark.parametrize("raw,model,words", [
    ({**V3_DRAFT, "vocab_size": None}, None, "deepseek-v3, kimi-k2 all match its hidden_size 7168; name the target"),
    ({"hidden_size": 12345}, None, "no built-in target matches its hidden_size 12345"),
    (V3_DRAFT, "tiny", "built for a target of hidden size 7168 (hidden_size), and --model tiny has hidden_size 64"),
    ({"hidden_size": 7168, "target_hidden_size": 4096}, "deepseek-v3", "hidden size 4096 (target_hidden_size)"),
])
def test_a_target_the_draft_does_not_fit_is_refused(raw, model, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        target_for(draft(raw), model, [], 2)


def test_a_width_mismatch_is_one_line_from_the_cli(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V3_DRAFT))
    r = run_cli("triage", "--draft-config", str(path), "--server", "sglang@0.5.12", "--model", "tiny")
    assert_one_line_error(r, "name the draft's target with --model")


def test_the_readme_storys_old_fix_applied_is_no_longer_a_false_finding(tmp_path):
    """Issue 52, item 1: applying the README's finding-4 fix as it used to read (0.5.14, ids [2, 30, 58]) makes the
    capture hold; ids-changed judged by the positions the server captures is then a note, not a finding."""
    raw = json.loads((BUILTIN_CONFIGS / "drafts" / "deepseek-v3-edited-ids.json").read_text())
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    r = run_cli("triage", "--draft-config", str(path), "--server", "sglang@0.5.14", "--tp", "8", "--train",
                "specforge-ids:1,29,57")
    assert r.returncode == 0, r.stdout
    assert "VERDICT: nothing found" in r.stdout and "captures the trained positions from them" in r.stdout


@pytest.mark.parametrize("layers,words", [
    ("2", ["sglang's default ids [2, 1, -1] for 2 layers: the config names none"]),
    ("4", ["ids [2, 2, 1] name out(1) more than once on 4 layers", "the capture is 2 x 7168 = 14336"]),
])
def test_a_truncation_flags_the_default_ids_it_breaks(tmp_path, layers, words):
    """Truncating a full-size target: the engine's default ids (the config names none) crash, drop or collapse
    on few layers; each is a finding that says the ids were the default, in the real config's widths."""
    raw = {k: v for k, v in V3_DRAFT.items() if k != "eagle_config"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    r = run_cli("triage", "--draft-config", str(path), "--server", "sglang@0.5.12", "--tp", "2",
                "--override", f"num_hidden_layers={layers}", "--json")
    assert r.returncode == 1, r
    causes = " ".join(f["cause"] for f in json.loads(r.stdout)["findings"] if f["kind"] == "dropped-slot")
    for w in words:
        assert w in causes, causes


def test_a_speculators_draft_names_its_verifier():
    """hidden_size 4096 fits four built-ins; the speculators format's verifier architectures pick one."""
    raw = {"hidden_size": 4096, "speculators_config": {"verifier": {"architectures": ["LlamaForCausalLM"]}}}
    assert target_for(draft(raw), None, [], 2).name == "llama-3.1-8b"
    with pytest.raises(UsageError, match="llama-3.1-8b, qwen3-235b-a22b, qwen3-8b, qwen3.5-9b all match its hidden_size 4096"):
        target_for(draft({"hidden_size": 4096}), None, [], 2)
