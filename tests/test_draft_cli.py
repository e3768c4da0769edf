"""`tpsim draft DIR`: each planted defect found through the command line (exit 1, one finding each, --json as
data), a clean draft passes (exit 0), and unreadable input is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from clirun import assert_one_line_error, run_cli
from test_draft_checkpoint import CONFIG, clean_tensors, write
from tpsim.draft.config import DraftConfig


def drafted(tmp_path, config=CONFIG, change=None):
    tensors = clean_tensors(DraftConfig.from_json(CONFIG))
    (change or (lambda t: None))(tensors)
    return write(tmp_path / "draft", config, tensors)


def test_a_clean_draft_passes(tmp_path):
    r = run_cli("draft", str(drafted(tmp_path)))
    assert r.returncode == 0 and "\nVERDICT: nothing found\n" in r.stdout, r


@pytest.mark.parametrize("plant,defect", [
    (lambda t: t.pop("embed_tokens.weight"), "embed-absent"),
    (lambda t: t.__setitem__("fc.weight", torch.zeros(16, 32)), "fc-width"),
    (lambda t: t["d2t"].__setitem__(0, 10_000), "vocab-map"),
    (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), "loader-refuses-key"),  # vLLM's, in every release
])
def test_each_planted_defect_is_a_finding(tmp_path, plant, defect):
    path = drafted(tmp_path, change=plant)
    r = run_cli("draft", str(path), "--json")
    assert r.returncode == 1, r
    assert defect in [f["defect"] for f in json.loads(r.stdout)["findings"]], r.stdout
    text = run_cli("draft", str(path / "config.json"))
    assert text.returncode == 1 and f"FINDING 1: " in text.stdout and "  fix: " in text.stdout, text


def test_the_target_names_fcs_width(tmp_path):
    r = run_cli("draft", str(drafted(tmp_path)), "--model", "tiny", "--json")  # tiny: hidden 64, fc takes 3 x 16
    assert r.returncode == 1 and "fc-width" in [f["defect"] for f in json.loads(r.stdout)["findings"]], r


@pytest.mark.parametrize("make,words", [
    (lambda p: p, "no draft config.json there"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{nope"))[0] or p, "is not a JSON draft config"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text('{"hidden_size": 8}'))[0] or p, "needs hidden_size"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps(CONFIG)),
                (p / "model.safetensors").write_bytes(b"\\x00" * 20))[0] or p, "not a readable safetensors"),
])
def test_unreadable_drafts_are_one_line(tmp_path, make, words):
    path = make(tmp_path / "d")
    assert_one_line_error(run_cli("draft", str(path)), words)
