"""Engine profiles: every profile's id mapping round-trips through positions, each cited behaviour
gives the outcome its source shows (tables written from the cited code), the registry picks the
profile a version string names, and the CLI refuses bad profiles in one line."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from safetensors import safe_open

from clirun import assert_one_line_error, run_cli, run_clis
from tpsim.capture import Position, PositionKind
from tpsim.base.errors import UsageError
from tpsim.profiles.draft import read_ids
from tpsim.profiles.findings import replay_findings
from tpsim.profiles.profile import EmbedId, Gpu, Numbering, Order, Served
from tpsim.profiles.registry import all_profiles, lookup
from tpsim.profiles.replay import Fate, replay
from tpsim.profiles.inverse import ids_for_position

PROFILES = all_profiles()
NAMES = [p.name for p in PROFILES]


def positions(spec: str, ids, L: int, model: str = "deepseek_v2") -> list[str]:
    return [str(p) for p in replay(lookup(spec, model), ids, L).positions]


# --- properties over every profile ------------------------------------------------------------

@example(name="sglang@0.5.13:deepseek_v2", L=4, b=1)  # out(0) alone: id 1 turns the +1 on, id 0 is the embedding
@example(name="sglang@0.5.13:deepseek_v2", L=61, b=2)  # the first id 1 switches the +1 on: alone, 1 is not id 1
@example(name="sglang@0.5.17:gpt_oss", L=36, b=36)  # the final boundary, reachable only as the largest id
@given(name=st.sampled_from(NAMES), L=st.integers(4, 128), b=st.integers(0, 129))
def test_id_mapping_round_trips_through_positions(name, L, b):
    """For every profile, L and boundary: the id the profile needs for a position captures exactly
    that position, and every interior boundary of a serving engine has an id."""
    p = lookup(name, "deepseek_v2")
    b = min(b, L)
    want = Position.at_boundary(b)
    j = ids_for_position(p, want, L)
    if j is not None:
        rep = replay(p, [j], L)
        assert rep.positions == [want] and rep.failure is None and not rep.dropped
    alone_unreachable = b == 1 and p.behaviour.numbering.value is Numbering.PLUS_ONE_IF_FIRST_IS_1
    if 1 <= b <= L - 1 and p.engine in ("sglang", "vllm") and not alone_unreachable and p.behaviour.captures:
        assert j is not None, f"{name} cannot reach {want} on {L} layers"


@example(name="sglang@0.5.17:deepseek_v2", L=4, ids=[-1])  # the packer captured nothing: the unpack fails
@example(name="vllm@0.17.0:qwen3_5", L=4, ids=[0])  # the model class ignores the ids: the unpack fails
@example(name="vllm@0.18.0:qwen3_5", L=4, ids=[0])  # the setter refuses at start-up
@given(name=st.sampled_from(NAMES), L=st.integers(4, 128), ids=st.lists(st.integers(-3, 131), min_size=1, max_size=5))
def test_replay_accounts_for_every_id(name, L, ids):
    """Every id is captured, merged with an equal one, dropped, or fails the run; the capture holds
    exactly the captured slots, ascending for loop-order engines, list order for the others; a
    dropped slot always comes with a finding that names it; a model class that never takes the ids captures
    nothing, fails where the engine's words say so, and always comes with a finding."""
    p = lookup(name, "deepseek_v2")
    if p.behaviour.config.value.hard_coded:
        ids_in = None
    else:
        ids_in = ids
    rep = replay(p, ids_in, L)
    captured = [s for s in rep.slots if s.fate is Fate.CAPTURED]
    assert len(rep.positions) == len(captured)
    if p.behaviour.order.value is Order.ASCENDING:
        keys = [q.sort_key() for q in rep.positions]
        assert keys == sorted(keys) and len(set(rep.positions)) == len(rep.positions)
    else:
        assert rep.positions == [s.position for s in captured]
    failing = any(s.fate in (Fate.CRASHES, Fate.REFUSED, Fate.FAILS) for s in rep.slots)
    ignored = any(s.fate is Fate.IGNORED for s in rep.slots)
    assert not ignored or (not rep.positions and all(s.fate is Fate.IGNORED for s in rep.slots))
    assert (rep.failure is not None) == (failing or ignored and bool(p.behaviour.wiring.error))
    found = [str(f) for f in replay_findings(rep, 64)]
    for s in rep.dropped:
        assert any(f"slot {s.index}: id {s.id} " in f for f in found)
    merged = any(s.fate is Fate.MERGED for s in rep.slots)  # the capture narrower than the draft's fc: a finding
    assert bool(found) == (failing or bool(rep.dropped) or merged or ignored)


@given(L=st.integers(7, 200))
def test_every_default_selects_the_same_tensors(L):
    """SGLang's, vLLM's, SpecForge's and EAGLE's defaults pick out(1), out(L//2-1), out(L-4) in
    every version (transformers has none)."""
    want = [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, L // 2 - 1), Position(PositionKind.OUT, L - 4)]
    for p in PROFILES:
        if p.engine != "transformers" and p.behaviour.captures:  # a model class that never captures: nothing
            assert replay(p, None, L).positions == want, p.name


def test_there_are_at_least_12_profiles_each_with_sources():
    assert len(PROFILES) >= 12
    for p in PROFILES:
        assert p.sources() and all(s.repo and s.ref for s in p.sources()), p.name
    assert len(set(NAMES)) == len(NAMES)


# --- each behaviour pinned to the code it cites -----------------------------------------------
# (profile, model, L, ids) -> (positions, fates); read from the source each profile cites

PINNED = {
    # SGLang deepseek_v2.py: [val + 1]; 0.5.13 (#25454): +1 only when the first id is 1
    ("sglang@0.5.12", "deepseek_v3", 61, (1, 29, 57)): ["out(1)", "out(29)", "out(57)"],
    ("sglang@0.5.12", "deepseek_v3", 61, (2, 30, 58)): ["out(2)", "out(30)", "out(58)"],
    ("sglang@0.5.13", "deepseek_v3", 61, (2, 30, 58)): ["out(1)", "out(29)", "out(57)"],
    ("sglang@0.5.13", "deepseek_v3", 61, (1, 29, 57)): ["out(1)", "out(29)", "out(57)"],
    ("sglang@0.5.13", "deepseek_v3", 61, (1,)): ["out(1)"],  # out(0) needs an id list that does not start with 1
    ("sglang@0.5.13", "deepseek_v3", 61, (2, 1)): ["out(0)", "out(1)"],
    # out of range: an internal id >= L is never matched, the slot silently missing
    ("sglang@0.5.12", "deepseek_v3", 61, (1, 29, 60)): ["out(1)", "out(29)"],
    # 0.5.14 (#28343): prepare_attn sets residual = hidden_states at layer 0: the embedding, no crash
    ("sglang@0.5.14", "deepseek_v3", 61, (0, 29, 57)): ["embed", "out(28)", "out(56)"],
    # and the first id is not 1, so no +1: -1 matches no layer and is silently dropped
    ("sglang@0.5.14", "deepseek_v3", 61, (-1, 29, 57)): ["out(28)", "out(56)"],
    # Qwen2 guards residual None; the capture loop is ascending whatever the list order
    ("sglang@0.5.12", "qwen2", 28, (20, -1, 5)): ["embed", "out(5)", "out(20)"],
    # GPT-OSS #32226 / #32334: [24, 30, 36] on 36 layers
    ("sglang@0.5.16", "gpt_oss", 36, (24, 30, 36)): ["out(24)", "out(30)"],
    ("sglang@0.5.17", "gpt_oss", 36, (24, 30, 36)): ["out(23)", "out(29)", "out(35)"],
    ("sglang@0.5.17", "gpt_oss", 36, (23, 29, 34)): ["out(23)", "out(29)", "out(34)"],
    # vLLM DeepSeek: before layer j; id L only from #46973 (0.25.0)
    ("vllm@0.24.0", "deepseek_v3", 61, (2, 30, 61)): ["out(1)", "out(29)"],
    ("vllm@0.25.0", "deepseek_v3", 61, (2, 30, 61)): ["out(1)", "out(29)", "out(60)"],
    # vLLM EagleModelMixin: id 0 is the embedding, id L the last layer's output
    ("vllm", "llama", 32, (0, 16, 32)): ["embed", "out(15)", "out(31)"],
    # SpecForge's HF-hook backend (before 7d1fbf08): out(j), list order
    ("specforge@2026-07-01", "llama", 32, (20, 1, 10)): ["out(20)", "out(1)", "out(10)"],
    # SpecForge through SGLang: ascending; a DeepSeek target takes +1 only when the first id is 1
    ("specforge", "llama", 32, (20, 1, 10)): ["out(1)", "out(10)", "out(20)"],
    ("specforge", "deepseek_v3", 61, (10, 35, 55)): ["out(9)", "out(34)", "out(54)"],
    ("specforge", "deepseek_v3", 61, (1, 35, 55)): ["out(1)", "out(35)", "out(55)"],
    # transformers: an index into output_hidden_states, L = the final norm's output, repeats kept
    ("transformers", "llama", 32, (0, 32, 0)): ["embed", "final", "embed"],
    # EAGLE: hard-coded {2, L//2, L-3} before layer: ids are not read
    ("eagle", "llama", 32, (5, 6, 7)): ["out(1)", "out(15)", "out(28)"],
}


@pytest.mark.parametrize("case", sorted(PINNED, key=str), ids=str)
def test_pinned_outcomes(case):
    spec, model, L, ids = case
    assert positions(spec, list(ids), L, model) == PINNED[case]


@pytest.mark.parametrize("spec,model,ids,text", [
    ("sglang@0.5.12", "deepseek_v3", [-1, 29, 57], "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'"),
    ("vllm@0.33.0", "deepseek_v3", [0, 29, 57], "TypeError: unsupported operand type(s) for +"),
    ("sglang@0.5.12", "qwen3_moe", [1, 29, 47], "refuses"),  # setattr(self.layers[48]): IndexError at start-up
    ("specforge@2026-07-01", "llama", [1, 1, 20], "refuses a repeated id"),
    ("specforge", "llama", [1, 20, 31], "refuses"),  # SGLang drops internal 32; SpecForge checks the width
])
def test_engine_failures_name_the_engine_error(spec, model, ids, text):
    L = 48 if model == "qwen3_moe" else 32 if model == "llama" else 61
    rep = replay(lookup(spec, model), ids, L)
    assert rep.failure is not None and text in rep.failure
    assert rep.positions == [] or rep.crashed or rep.refused


def test_crash_fix_names_the_version_that_captures_the_embedding():
    (f,) = map(str, replay_findings(replay(lookup("sglang@0.5.12", "deepseek_v3"), [-1, 29, 57], 61), 7168))
    assert "sglang@0.5.14:deepseek_v3 or later" in f
    assert lookup("sglang@0.5.14", "deepseek_v3").behaviour.embed.value is EmbedId.CAPTURED


def test_dropped_fix_names_the_id_that_works_or_the_version():
    (f,) = map(str, replay_findings(replay(lookup("vllm@0.24.0", "deepseek_v3"), [2, 30, 61], 61), 7168))
    assert "slot 2: id 61" in f and "2 x 7168 = 14336" in f and "vllm@0.25.0:deepseek_v3 reaches it (id 61)" in f
    (f,) = map(str, replay_findings(replay(lookup("sglang@0.5.16", "gpt_oss"), [24, 30, 36], 36), 2880))
    assert "sglang@0.5.17:gpt_oss reaches it" in f


# --- reading the draft config as each engine does ---------------------------------------------

NESTED = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
TOP = {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}
CONFIGS = {  # (profile, model, config) -> (ids read, fell back with a reason, failure text)
    ("sglang", "deepseek_v3", "nested"): ([1, 29, 57], False, None),
    ("sglang", "deepseek_v3", "top"): (None, True, None),  # model_runner reads only the nested key
    ("sglang", "deepseek_v3", "both"): ([1, 29, 57], False, None),
    ("sglang", "deepseek_v3", "off"): (None, False, "use_aux_hidden_state is false"),
    ("sglang", "deepseek_v3", "nested-empty"): (None, False, "unpack fails"),
    ("vllm@0.28.0", "deepseek_v3", "nested"): ([1, 29, 57], False, None),  # runner v1 reads the nested key
    ("vllm", "deepseek_v3", "nested"): (None, True, None),  # runner v2 serves every model from 0.29.0: not read
    ("vllm", "deepseek_v3", "both"): ([2, 30, 58], False, None),  # the top-level key first
    ("vllm", "deepseek_v2", "nested"): (None, True, None),  # runner v2 does not
    ("vllm@0.22.0", "deepseek_v2", "nested"): ([1, 29, 57], False, None),  # runner v1 reads it from 0.22.0
    ("vllm@0.18.0", "deepseek_v2", "nested"): (None, True, None),  # runner v1 up to 0.19.1: the top-level key only
    ("vllm", "llama", "top-empty"): (None, False, None),  # an empty list is falsy: the default, silently
    ("vllm", "llama", "dflash"): ([4, 8, 12], False, None),  # DFlash ids + 1
    ("vllm", "llama", "off"): (None, False, "use_aux_hidden_state is false"),
    ("specforge", "llama", "top"): (None, True, None),
    ("specforge", "llama", "nested-empty"): (None, False, "exactly three ids"),
    ("eagle", "llama", "top"): (None, False, None),  # hard-coded: nothing read, nothing to fall back from
}
RAW = {"nested": NESTED, "top": TOP, "both": {**NESTED, **TOP},
       "off": {"eagle_config": {"use_aux_hidden_state": False}},
       "nested-empty": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}},
       "top-empty": {"eagle_aux_hidden_state_layer_ids": []}, "dflash": {"dflash_config": {"target_layer_ids": [3, 7, 11]}}}


@pytest.mark.parametrize("case", sorted(CONFIGS), ids=str)
def test_draft_config_is_read_as_the_engine_reads_it(case):
    spec, model, raw = case
    ids, fell_back, failure = CONFIGS[case]
    got = read_ids(lookup(spec, model), RAW[raw])
    assert got.ids == ids and bool(got.fallback) == fell_back
    assert (got.failure is None) if failure is None else (failure in got.failure)


# --- the registry --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,model,name", [
    ("sglang@0.5.12", "deepseek_v3", "sglang@0.5.11:deepseek_v3"),
    ("sglang@0.5.12.post1", "deepseek_v3", "sglang@0.5.11:deepseek_v3"),
    ("sglang@v0.5.13", "deepseek_v3", "sglang@0.5.13:deepseek_v3"),
    ("sglang@2026-06-20", "deepseek_v3", "sglang@0.5.13:deepseek_v3"),  # 0.5.13 out 2026-06-11, 0.5.14 06-26
    ("sglang", "deepseek_v3", "sglang@0.5.22:deepseek_v3"),
    ("sglang@0.5.12", "deepseek_v2", "sglang@0.5.11:deepseek_v2"),  # DeepSeek-V2's architecture: its own line
    ("sglang@latest:gpt_oss", "deepseek_v3", "sglang@0.5.21:gpt_oss"),
    ("vllm@0.24.0", "deepseek_v3", "vllm@0.22.0:deepseek_v3"),
    ("specforge@2026-07-13", "llama", "specforge@2025-09-01:any"),  # #198 on: the HF-hook backend
    ("specforge@0.1.0", "llama", "specforge@0.1.0:any"),  # the PyPI release: hard-coded layers
    ("specforge@0.2.0", "deepseek_v3", "specforge@2026-07-14:deepseek_v2"),  # the SGLang backend
    ("specforge@2026-07-14", "llama", "specforge@2026-07-14:any"),
    ("hf", "llama", "transformers:any"),
])
def test_lookup(text, model, name):
    assert lookup(text, model).name == name


@pytest.mark.parametrize("name", NAMES)
def test_every_profile_name_looks_up_itself(name):
    assert lookup(name, "deepseek_v2").name == name


@pytest.mark.parametrize("text,words", [
    ("tgi", ["unknown profile 'tgi'", "sglang, vllm"]),
    ("sglang@0.9.0", ["is profiled for 0.5.6 .. 0.5.23", "0.9.0 is newer"]),  # one shape, older or newer
    ("sglang@0.4.0", ["is profiled for 0.5.6 .. 0.5.23", "0.4.0 is older"]),
    ("sglang@0.5.2", ["is profiled for 0.5.6 .. 0.5.23", "0.5.2 is older"]),
    ("vllm:mamba", ["no profile for model 'mamba'", "qwen3_moe"]),
    ("sglang@yesterday", ["neither a release", "YYYY-MM-DD"]),
    ("specforge@1.0", ["is profiled for", "1.0 is newer"]),
    ("eagle@1.0", ["no numbered releases", "eagle@2026-07-01"]),
])
def test_bad_profiles_say_what_exists(text, words):
    with pytest.raises(UsageError) as e:
        lookup(text, "deepseek_v2")
    for w in words:
        assert w in str(e.value)


# --- the CLI ---------------------------------------------------------------------------------------

def test_profiles_json_lists_every_profile_with_sources():
    r = run_cli("profiles", "--json")
    assert r.returncode == 0, r
    got = json.loads(r.stdout)
    assert [p["name"] for p in got] == NAMES
    for p in got:
        assert {"name", "engine", "models", "versions", "sources"} <= set(p) and p["sources"]


def test_profiles_name_shows_the_one_profile_the_list_holds():
    """`tpsim profiles NAME` for every profile: the same record `--json` lists, found by the name it prints, and
    any version inside its interval names it too (issue 51, deliver 4)."""
    from tpsim.cli.profiles import classified, entries, named, to_dict
    by_line = classified()
    for p, latest in entries():
        got, last, _ = named(p.name)
        assert got.name == p.name and last.name == latest.name
        assert to_dict(got, last, by_line[(p.engine, p.family)]) == to_dict(p, latest, by_line[(p.engine, p.family)])
        inside = [c.release for c in by_line[(p.engine, p.family)] if c.profile.name == p.name]
        for release in inside[-1:]:
            assert named(f"{p.engine}@{release}:{p.family}")[0].name == p.name


def test_profiles_name_prints_behaviours_sources_quotes_and_each_release():
    runs = run_clis({"one": ["profiles", "sglang@0.5.18:deepseek_v3"], "json": ["profiles", "vllm@0.25.0:llama", "--json"],
                     "no_model": ["profiles", "sglang@0.5.18"], "old": ["profiles", "sglang@0.4.0:llama"],
                     "model": ["profiles", "vllm:mamba"]})
    r = runs["one"]
    assert r.returncode == 0, r
    p = lookup("sglang@0.5.18", "deepseek_v3")
    for f in ("numbering", "site", "cp", "tbo"):
        c = getattr(p.behaviour, f)
        assert f"  {f}: " in r.stdout and c.source.quote.split()[0] in r.stdout, f
    assert "SGLANG_ENABLE_CP_V2" in r.stdout and "  releases:" in r.stdout
    assert "    0.5.18: changed: " in r.stdout  # the fingerprints' class of each release it holds for
    got = json.loads(runs["json"].stdout)
    assert got["name"] == lookup("vllm@0.25.0", "llama").name and got["behaviour"]["numbering"]["quote"]
    assert_one_line_error(runs["no_model"], ["names no model file", "sglang@0.5.18:MODEL", "deepseek_v3"])
    assert_one_line_error(runs["old"], ["0.4.0 is older"])
    assert_one_line_error(runs["model"], ["no profile for model 'mamba'"])


def test_resolve_server_reports_the_dropped_slot():
    r = run_cli("resolve", "--server", "sglang@0.5.16:gpt_oss", "--num-layers", "36", "--layers", "24,30,36", "--json")
    assert r.returncode == 1, r
    got = json.loads(r.stdout)
    assert got["positions"] == ["out(24)", "out(30)"] and [s["fate"] for s in got["slots"]][2] == "dropped"
    assert "sglang@0.5.17:gpt_oss reaches it" in got["findings"][0]


@pytest.mark.parametrize("argv,words", [
    (["resolve", "--server", "nope", "--num-layers", "8"], ["unknown profile 'nope'"]),
    (["resolve", "--num-layers", "8"], ["--convention NAME or --server PROFILE"]),
    (["check", "--server", "sglang", "--convention", "vllm-ids", "--tp", "1"], ["--server and --convention"]),
    (["capture", "--server", "vllm@0.1.0", "--out", "/tmp/tpsim-never-written.safetensors"],
     ["is profiled for 0.18.0 .. 0.34.0", "0.1.0 is older"]),
])
def test_bad_server_input_is_one_line(argv, words):
    assert_one_line_error(run_cli(*argv), words)


# --- the auto-enable rule of all-reduce fusion, as server_args.py writes it per version ---------

@pytest.mark.parametrize("spec,served,on", [
    ("sglang@0.5.6", Served(8, Gpu.H200), False),  # SM100 only
    ("sglang@0.5.6", Served(8, Gpu.B200), True),
    ("sglang@0.5.12", Served(8, Gpu.H200), True),
    ("sglang@0.5.12", Served(8, Gpu.H20), False),  # not H20 until 0.5.13
    ("sglang@0.5.13", Served(8, Gpu.H20), True),
    ("sglang@0.5.13", Served(8, Gpu.B200, nnodes=2), False),  # one node until 0.5.14
    ("sglang@0.5.14", Served(8, Gpu.B200, nnodes=2), True),  # several nodes on SM100
    ("sglang@0.5.14", Served(8, Gpu.H200, nnodes=2), False),
    ("sglang@0.5.14", Served(8, Gpu.H200, dp_attention=True), False),
    ("sglang@0.5.14", Served(8, Gpu.H200, deepep=True), False),  # moe_a2a_backend must be none
    ("sglang@0.5.14", Served(1, Gpu.H200), False),
    ("sglang@0.5.14", Served(8, Gpu.A100), False),
    ("sglang:llama", Served(8, Gpu.H200), False),  # LlamaForCausalLM is on no auto-enable list
])
def test_fusion_auto_enable_follows_server_args(spec, served, on):
    assert lookup(spec, "deepseek_v3").behaviour.fusion_auto.value.on(served) is on


# --- --server on check and capture, end to end on real ranks -------------------------------------

def test_check_server_fails_on_a_dropped_slot_and_names_it():
    r = run_cli("check", "--server", "sglang@0.5.12", "--layers", "1,3,7", "--tp", "1,2")
    assert r.returncode == 1, r
    assert "capture is [T, 2 x 64]" in r.stdout  # the ranks agree on what the engine captures
    assert "FAIL: slot 2: id 7 becomes internal id 8" in r.stdout and "2 x 64 = 128" in r.stdout


def test_check_server_reads_the_draft_config_as_the_engine_does():
    r = run_cli("check", "--server", "vllm@0.22.0:deepseek_v2", "--draft-config",
                "configs/scenarios/align-default-fallback.json", "--tp", "1", "--override", "num_hidden_layers=61",
                "--override", "n_routed_experts=2", "--override", "num_experts_per_tok=1", "--override", "n_group=1",
                "--override", "topk_group=1", "--seq-len", "2", "--json")
    assert r.returncode == 0, r
    got = json.loads(r.stdout)["convention"]
    assert got["positions"] == ["out(9)", "out(34)", "out(54)"]  # runner v1 reads the nested key: before layer j
    assert any("ids [10, 35, 55] from eagle_config.eagle_aux_hidden_state_layer_ids" in n for n in got["notes"])


def test_capture_server_writes_what_the_engine_captures(tmp_path):
    out = tmp_path / "cap.safetensors"
    r = run_cli("capture", "--server", "vllm@0.24.0", "--layers", "2,4,8", "--tp", "2", "--out", str(out))
    assert r.returncode == 0, r
    assert "aux_hidden_states [16, 128]" in r.stdout and "warning: slot 2: id 8" in r.stdout
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("aux_hidden_states").shape == (16, 128) and f.metadata()["server"] == "vllm@0.24.0"


def test_capture_server_crash_writes_nothing(tmp_path):
    out = tmp_path / "cap.safetensors"
    r = run_cli("capture", "--server", "vllm", "--layers", "0,4,5", "--tp", "1", "--out", str(out))
    assert r.returncode == 1 and not out.exists(), r
    assert "TypeError: unsupported operand type(s) for +" in r.stderr and "nothing written" in r.stderr
