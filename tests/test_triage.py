"""`tpsim triage` end to end on the gloo pool: the README example finds both the served-mode capture
bug at TP=8 and the train/serve key fallback, each with its fix; each other finding kind on a
config built for it; a clean config passes; bad input is one line."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from clirun import ROOT, assert_one_line_error, run_cli

NESTED_135 = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}


def readme_triage() -> list[str]:
    """The triage command the README opens with, as written."""
    block = re.search(r"```bash\n(tpsim triage [^\n]+)\n```", (ROOT / "README.md").read_text())
    assert block, "the README has no ```bash block with a tpsim triage command"
    return shlex.split(block.group(1))[1:]


def triage_json(tmp_path, raw: dict | None, *argv: str) -> tuple[int, dict]:
    args = list(argv)
    if raw is not None:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(raw))
        args = ["--draft-config", str(path), *args]
    r = run_cli("triage", *args, "--json")
    assert r.returncode in (0, 1), r
    return r.returncode, json.loads(r.stdout)


def kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


KEY_FALLBACK_EXAMPLE = ["triage", "--draft-config", "configs/drafts/ids-at-top-level.json", "--server",
                        "sglang@0.5.12:deepseek_v3", "--tp", "8"]  # docs/triage.md's worked example


def test_docs_example_finds_the_served_mode_bug_and_the_key_fallback():
    r = run_cli(*KEY_FALLBACK_EXAMPLE)
    assert r.returncode == 1, r
    out = r.stdout
    assert "FINDING 1: config key fallback" in out and "FINDING 2: the served mode breaks the capture" in out
    assert 'fix: write "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}' in out
    assert "Partial(sum): captured before a deferred all-reduce" in out and "TP=8" in out
    assert "fix: serve with sglang@0.5.14 or later (#28343, #28789)" in out
    assert out.count("fix replayed: the finding clears, and no other appears") == 2
    assert "source: sgl-project/sglang python/sglang/srt/server_args.py @v0.5.10" in out  # 0.5.12 runs 0.5.10's rule
    assert "VERDICT: 2 findings" in out
    steps = {line.split(": ")[1] for line in r.stderr.splitlines() if line.startswith("tpsim: ")}
    assert "triage" in steps and any(s.startswith("replaying the fix for finding 2 of 2") for s in steps), steps
    assert "plan replayed as a whole: nothing found" in out  # the same change as finding 2's fix: replayed once


def test_the_fixed_version_and_the_fixed_config_find_nothing(tmp_path):
    code, rep = triage_json(tmp_path, NESTED_135, "--server", "sglang:deepseek_v3", "--tp", "2")
    assert code == 0 and rep["ok"] and rep["findings"] == [], rep["findings"]
    assert rep["served_mode"]["mode"]["name"] == "ar-fusion" and rep["served_mode"]["capture_strategy"] == "in-layer"
    assert all(row["ok"] for row in rep["check"]["rows"])


def test_fusion_is_not_auto_enabled_on_h20_before_0_5_13(tmp_path):
    code, rep = triage_json(tmp_path, NESTED_135, "--server", "sglang@0.5.12:deepseek_v3", "--tp", "2", "--gpu", "H20")
    assert code == 0 and rep["served_mode"]["mode"]["name"] == "tp", rep["served_mode"]


def test_fusion_is_never_auto_enabled_for_deepseek_v2(tmp_path):
    """SGLang's rule lists DeepseekV3ForCausalLM, not DeepseekV2ForCausalLM (server_args.py 0.5.7 .. 0.5.14,
    arg_groups/overrides.py 0.5.16 .. 0.5.23): the tiny target's own deepseek_v2 stays in plain TP."""
    code, rep = triage_json(tmp_path, NESTED_135, "--server", "sglang@0.5.12", "--tp", "2")
    assert rep["serve_profile"] == "sglang@0.5.11:deepseek_v2" and rep["served_mode"]["mode"]["name"] == "tp"
    assert "plain TP: all-reduce fusion stays off (never: the model is not on the auto-enable list)" in \
        rep["served_mode"]["why"]


def test_triage_under_pp_is_the_engines_start_up_refusal(tmp_path):
    code, rep = triage_json(tmp_path, {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}, "--server", "sglang@0.5.23",
                            "--pp", "2")
    (f,) = rep["findings"]
    assert code == 1 and f["kind"] == "engine-refuses" and rep["check"] is None, rep
    assert "refuses --pp 2 with an EAGLE-3 draft at start-up, so nothing runs" in f["cause"]
    assert "Pipeline parallelism currently only supports EAGLE (non-multi-layer)" in f["cause"]


def test_triage_reports_the_stage_local_numbering_check_replayed(tmp_path):
    """vLLM's llama.py up to 0.29.0 numbers the last stage's layers from 0: check's replay under --pp finds each
    moved slot (typed, kind `pipeline`), and triage reports those findings with the cited file and a replayed fix."""
    code, rep = triage_json(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}, "--server",
                            "vllm@0.25.0:llama", "--model", "tiny-llama", "--pp", "2")
    moved = [f for f in rep["findings"] if f["kind"] == "pipeline"]
    assert code == 1 and [f["cause"].split(" is tested")[0] for f in moved] == [
        f"pipeline parallel: out({i})" for i in (1, 3, 5)], rep["findings"]
    for f in moved:
        assert f["sources"] == ["vllm-project/vllm vllm/model_executor/models/llama.py @v0.18.0"] and f["fix_replayed"]
        assert "which numbers its layers from 0" in f["cause"] and "fix:" not in f["cause"]


def test_deepep_capture_is_token_local_before_0_5_7(tmp_path):
    code, rep = triage_json(tmp_path, NESTED_135, "--server", "sglang@0.5.6", "--tp", "2",
                            "--moe-a2a-backend", "deepep")
    assert code == 1 and kinds(rep) == ["served-mode", "graph-ids"], rep["findings"]  # graphs: fixed in 0.5.11
    assert rep["served_mode"]["capture_strategy"] == "local"
    assert "0.5.7 or later" in rep["findings"][0]["fix"] and "Shard(dim=0)" in rep["findings"][0]["cause"]


def test_an_embedding_id_crashes_the_engine_and_the_upgrade_is_not_a_fix(tmp_path):
    """sglang 0.5.14 captures the embedding, but numbers the ids without +1: the same ids drop a slot
    there, so the upgrade the finding once advised is replayed, found to open a dropped slot, and not printed."""
    raw = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 5]}}
    code, rep = triage_json(tmp_path, raw, "--server", "sglang@0.5.12", "--tp", "2")
    assert code == 1 and "engine-fails" in kinds(rep)
    assert rep["notes"] == ["sglang@0.5.11:deepseek_v2 captures nothing from these ids; the check runs on the "
                            "positions training used (out(2), out(4))"]
    f = rep["findings"][kinds(rep).index("engine-fails")]
    assert "TypeError: unsupported operand type(s) for +" in f["cause"] and not f["fix_replayed"]
    assert "tried: serve with sglang@0.5.14 or later (#28343, #28789): clears it and opens a slot silently " \
           "dropped" in f["fix"]


def test_graphed_batches_capture_the_default_before_22836(tmp_path):
    code, rep = triage_json(tmp_path, NESTED_135, "--server", "sglang@0.5.10", "--tp", "2", "--gpu", "H20")
    assert code == 1 and kinds(rep) == ["graph-ids"], rep["findings"]
    assert "out(1), out(3), out(4)" in rep["findings"][0]["cause"] and "0.5.11" in rep["findings"][0]["fix"]


def test_capture_turned_off(tmp_path):
    raw = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": False}}
    code, rep = triage_json(tmp_path, raw, "--server", "vllm", "--tp", "1")
    (f,) = rep["findings"]
    assert code == 1 and f["kind"] == "capture-off" and f["fix_replayed"], f
    # vLLM reads its ids from the top level: turning capture on alone falls back to its default
    assert f["fix"] == 'remove use_aux_hidden_state: false from eagle_config, and write ' \
        '"eagle_aux_hidden_state_layer_ids": [2, 4, 6] in the draft config (the top level, which ' \
        'vllm@0.30.0:deepseek_v2 reads first) (captures out(1), out(3), out(5), what training captured)', f["fix"]
    assert "the check runs on the positions training used (out(1), out(3), out(5))" in rep["notes"][0]


@pytest.mark.parametrize("argv,words", [
    (["triage", "--draft-config", "configs/drafts/ids-at-top-level.json"], ["needs --server PROFILE"]),
    (["triage", "--draft-config", "configs/drafts/ids-at-top-level.json", "--server", "tgi"], ["unknown profile 'tgi'"]),
    (["triage", "--draft-config", "configs/drafts/nope.json", "--server", "sglang"], ["does not exist"]),
    (["triage", "--draft-config", "configs/drafts/ids-at-top-level.json", "--server", "sglang", "--gpu", "V100"],
     ["invalid choice: 'V100'"]),
    (["triage", "--draft-config", "configs/drafts/ids-at-top-level.json", "--server", "sglang", "--tp", "3"],
     ["3"]),
])
def test_bad_input_is_one_line(argv, words):
    assert_one_line_error(run_cli(*argv), words)


def test_a_lucky_default_is_a_warning_with_its_safeguard_and_a_clean_verdict_says_what_was_not_checked():
    """Issue 52, item 3: ids at a key vLLM never reads, whose default happens to capture the same positions: a
    WARNING naming the change that makes it hold on purpose; 'nothing found' then lists what triage did not check
    and the command that does."""
    r = run_cli("triage", "--draft-config", "configs/scenarios/align-default-fallback-coincidence.json", "--server",
                "vllm@0.30.0", "--model", "deepseek-v3", "--tp", "2")
    assert r.returncode == 0, r
    warning = next(line for line in r.stdout.splitlines() if line.startswith("WARNING: "))
    assert "works by coincidence" in warning and 'safeguard: write "eagle_aux_hidden_state_layer_ids": [2, 30, 58]' \
        in warning
    assert "VERDICT: nothing found" in r.stdout
    unchecked = r.stdout.split("not checked: ", 1)[1]
    assert "tpsim draft DIR --server vllm@0.30.0" in unchecked and "--measure" in unchecked and "tpsim observe" in unchecked
