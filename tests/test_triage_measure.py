"""`tpsim triage --draft DIR [--measure]`: the draft's checkpoint read beside its config (a checkpoint defect is a
finding), and with --measure the acceptance length as trained, as served and with each replayed fix, the fix
measured on the same sequences (on the tiny built-in with a seeded draft; the story on a real target is
tests/test_acceptance_smollm2.py)."""

from __future__ import annotations

import json

import torch

from clirun import assert_one_line_error, run_cli
from test_acceptance_cli import tiny_draft


def test_measure_gives_each_replayed_fix_its_acceptance(tmp_path):
    path = tiny_draft(tmp_path / "d", [-1, 3, 4])
    r = run_cli("triage", "--draft", str(path), "--server", "sglang@0.5.11", "--train", "specforge-ids:1,3,4",
                "--tp", "2", "--measure", "--new-tokens", "16", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    m = out["measured"]
    assert m["served"]["failure"] and m["served"]["acceptance_length"] is None  # the engine crashes on id -1
    fixed = [f["measured_with_fix"] for f in out["findings"] if f["fix_replayed"]]
    assert fixed and all(x["positions"] == m["trained"]["positions"] for x in fixed)
    assert all(x["acceptance_length"] == m["trained"]["acceptance_length"] for x in fixed)  # the fix gives it back
    text = run_cli("triage", "--draft", str(path), "--server", "sglang@0.5.11", "--train", "specforge-ids:1,3,4",
                   "--measure", "--new-tokens", "8")
    assert "measured (greedy chain drafting, k = 3, 8 sequences): AL " in text.stdout
    assert "  measured: AL " in text.stdout and "with the fix" in text.stdout


def test_a_checkpoint_defect_is_a_triage_finding(tmp_path):
    from test_draft_checkpoint import clean_tensors, write
    from test_acceptance_cli import DRAFT
    from tpsim.draft.config import DraftConfig
    config = {**DRAFT, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    tensors = clean_tensors(DraftConfig.from_json(config))
    tensors["fc.weight"] = torch.zeros(64, 128)  # two captures wide
    r = run_cli("triage", "--draft", str(write(tmp_path / "d", config, tensors)), "--server", "sglang@0.5.12",
                "--train", "specforge-ids:1,3,4", "--json")
    assert r.returncode == 1, r.stderr
    assert [f["defect"] for f in json.loads(r.stdout)["draft_findings"]] == ["fc-width"]


def test_measure_needs_the_weights_and_a_target_that_runs(tmp_path):
    path = tiny_draft(tmp_path / "d", [1, 3, 4])
    assert_one_line_error(run_cli("triage", "--draft-config", str(path / "config.json"), "--server", "sglang",
                                  "--measure"), "--measure runs the draft")
    r = run_cli("triage", "--draft", str(path), "--server", "sglang", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["measured"] is None, r.stderr
