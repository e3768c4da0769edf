"""`tpsim acceptance` from the command line on the tiny built-in (seeded weights, a seeded draft): the two
captures side by side, the same capture giving the same acceptance to the round, a served capture the engine
never feeds the draft (exit 1, not measured), prompts from a file, and bad input as one line (exit 2)."""

from __future__ import annotations

import json

import pytest

from clirun import assert_one_line_error, run_cli
from test_draft_checkpoint import clean_tensors, write
from tpsim.draft.config import DraftConfig

DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
         "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 8, "vocab_size": 1000, "draft_vocab_size": 200}


def tiny_draft(folder, ids=None, **extra):
    config = {**DRAFT, **extra}
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    return write(folder, config, clean_tensors(DraftConfig.from_json(config), seed=3))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return tiny_draft(tmp_path_factory.mktemp("d") / "draft", [1, 3, 4])


def test_the_same_capture_gives_the_same_acceptance(draft):
    """sglang@0.5.12 captures what SpecForge trained on here (out(1), out(3), out(4)): at TP 2 in plain TP the
    capture is the whole stream, so the rounds are the trained ones."""
    r = run_cli("acceptance", "--draft", str(draft), "--server", "sglang@0.5.12", "--tp", "2", "--new-tokens", "24",
                "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    t, s = out["trained"], out["served"]
    assert t["positions"] == s["positions"] == ["out(1)", "out(3)", "out(4)"]
    assert (t["tp"], s["tp"], s["mode"]) == (1, 2, "tp") and s["ranks_identical"]
    assert t["rounds"] == s["rounds"] > 0 and t["acceptance_length"] == s["acceptance_length"]
    assert out["difference"] == 0 and out["kept"] and out["sequences"] == 8 and out["answer_tokens"] > 0
    assert len(t["per_position"]) == out["steps"] == 3


def test_a_capture_the_engine_never_feeds_is_not_measured(tmp_path):
    """ids sglang@0.5.11 crashes on (an embedding id): the served side is not measured, exit 1."""
    path = tiny_draft(tmp_path / "d", [-1, 3, 4])
    r = run_cli("acceptance", "--draft", str(path), "--server", "sglang@0.5.11", "--train", "specforge-ids:1,3,4",
                "--new-tokens", "12")
    assert r.returncode == 1, r.stderr
    assert "served   " in r.stdout and "not measured:" in r.stdout
    assert "VERDICT: the engine never feeds the draft this capture" in r.stdout


def test_prompts_from_a_file(draft, tmp_path):
    ids = tmp_path / "prompts.txt"
    ids.write_text("1,2,3,4,5\n\n7, 8, 9\n")
    r = run_cli("acceptance", "--draft", str(draft), "--server", "vllm", "--prompts", str(ids), "--new-tokens", "10",
                "--steps", "2", "--json")
    assert r.returncode in (0, 1), r.stderr
    out = json.loads(r.stdout)
    assert out["sequences"] == 2 and out["answer_tokens"] == 20 and out["steps"] == 2


@pytest.mark.parametrize("argv,words", [
    (["--draft", "{draft}"], "acceptance needs --server"),
    (["--draft", "{draft}", "--server", "sglang", "--steps", "0"], "--steps"),
    (["--draft", "/nonexistent/draft", "--server", "sglang"], "no draft config.json there"),
    (["--draft", "{draft}", "--server", "sglang", "--prompts", "{bad}"], "is not comma-separated token ids"),
    (["--draft", "{draft}", "--server", "sglang", "--prompts", "/nonexistent.txt"], "cannot read it"),
    (["--draft", "{draft}", "--server", "sglang", "--model", "llama-3.1-8b"], "hidden size"),
])
def test_bad_input_is_one_line(draft, tmp_path, argv, words):
    bad = tmp_path / "bad.txt"
    bad.write_text("hello world\n")
    r = run_cli("acceptance", *[a.format(draft=draft, bad=bad) for a in argv])
    assert_one_line_error(r, words)


def test_a_target_too_big_for_this_machine_is_refused_not_stood_in(tmp_path):
    """On the CPU a target over 1 GiB would be a stand-in at toy widths, whose answers say nothing about
    acceptance: acceptance and triage --measure refuse it in one line."""
    import torch
    config = {**DRAFT, "hidden_size": 4096, "vocab_size": 128256, "num_attention_heads": 32, "head_dim": 128}
    folder = write(tmp_path / "big", config, {"fc.weight": torch.zeros(2, 2)})
    assert_one_line_error(run_cli("acceptance", "--draft", str(folder), "--server", "sglang",
                                  "--model", "llama-3.1-8b"), "too big to run here")
    assert_one_line_error(run_cli("triage", "--draft", str(folder), "--server", "sglang", "--model", "llama-3.1-8b",
                                  "--measure"), "too big to run here")
