"""SGLang's profiles against the released code (issue 34): each correction read from a wheel, as data
with its source, replayed as the engine does it; every source names the function it was read from and
quotes it (checked against the wheels when a cache of them is at hand)."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from clirun import assert_one_line_error, run_clis
from sglang_src import WHEELS, body, no_sources
from tpsim.capture.pipeline import PP_CAPTURES, Handoff
from tpsim.profiles import sglang, sglang_server
from tpsim.profiles.profile import Duplicates, FusionAuto, Gather, Gpu, OutOfRange, Served, Site, TboCapture
from tpsim.profiles.registry import lookup, version_key
from tpsim.profiles.replay import UNPACK_TEXT, Fate, replay

LINES = sglang.LINES
PROFILES = [p for line in LINES for p in line.profiles()]
def every_source():
    seen = {}
    for p in PROFILES:
        for s in p.sources():
            seen[s] = p.name
    return list(seen)


# --- every source: a release, a symbol, a quote ---------------------------------------------------

@pytest.mark.parametrize("source", every_source(), ids=lambda s: f"{s.path.split('/')[-1]}@{s.ref}:{s.symbol}")
def test_every_source_names_a_release_read_a_symbol_and_a_quote(source):
    assert source.ref.startswith("v") and source.ref[1:] in sglang_server.READ, source
    assert re.fullmatch(r"[A-Za-z_][\w.]*", source.symbol) and len(source.quote.split()) >= 3, source


@pytest.mark.parametrize("source", every_source(), ids=lambda s: f"{s.path.split('/')[-1]}@{s.ref}:{s.symbol}")
def test_every_quote_is_in_the_released_function(source):
    text = body(source.ref[1:], source.path, source.symbol)
    if text is None:
        no_sources(f"no unpacked sglang {source.ref} wheel under {WHEELS} (TPSIM_SGLANG_SRC)")
    assert text, f"{source.symbol} is not defined in {source.path} at {source.ref}"
    assert " ".join(source.quote.split()) in text, source


# --- pipeline parallelism: refused at start-up in every release ------------------------------------

PP_TEXTS = {  # release -> the start-up check's words (server_args.py, then arg_groups/validation_hook.py)
    "0.5.6": "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding, "
             "mixed chunked prefill.",
    "0.5.10": "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding, "
              "mixed chunked prefill.",
    "0.5.11": "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding",
    "0.5.17": "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding",
    "0.5.20": "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding",
    "0.5.21": "AssertionError: Pipeline parallelism currently only supports EAGLE (non-multi-layer) speculative "
              "decoding",
    "0.5.23": "AssertionError: Pipeline parallelism currently only supports EAGLE (non-multi-layer) speculative "
              "decoding",
}


@pytest.mark.parametrize("release", sorted(PP_TEXTS, key=version_key))
@pytest.mark.parametrize("model", ["deepseek_v2", "deepseek_v3", "llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_every_release_refuses_eagle3_under_pp_in_its_own_words(release, model):
    pp = lookup(f"sglang@{release}", model).behaviour.pp
    assert pp.value is Handoff.REFUSED and pp.error == PP_TEXTS[release], pp
    joined = pp.source.quote.replace('" "', "")  # adjacent string literals, as Python joins them
    assert pp.error.split(": ", 1)[1] in joined  # the text is the code's, as quoted


def test_a_refusal_is_not_a_capture_a_run_can_choose():
    assert Handoff.REFUSED not in PP_CAPTURES.values() and set(PP_CAPTURES) == {"last-stage", "handoff"}


def test_check_and_capture_under_pp_say_what_the_engine_says_and_write_nothing(tmp_path):
    out = tmp_path / "aux.safetensors"
    runs = run_clis({"check": ["check", "--pp", "2", "--tp", "1", "--server", "sglang@0.5.12", "--seq-len", "5"],
                     "capture": ["capture", "--pp", "2", "--server", "sglang@0.5.6", "--out", str(out)],
                     "plain": ["capture", "--pp", "2", "--out", str(out)]}, workers=2)
    check, capture = runs["check"], runs["capture"]
    assert check.returncode == 1, check  # a FAIL: the served configuration does not launch
    for words in ("sglang@0.5.11:deepseek_v2 refuses --pp 2 with an EAGLE-3 draft at start-up", PP_TEXTS["0.5.11"],
                  "server_args.py @v0.5.11, ServerArgs.check_server_args", "0.5.21 refuses it in other words"):
        assert words in check.stdout, (words, check)
    assert capture.returncode == 1 and PP_TEXTS["0.5.6"] in capture.stderr and "said so from 0.5.6" in capture.stderr
    assert "nothing written" in capture.stderr, capture
    assert_one_line_error(runs["plain"], ["capture runs no pipeline", "tpsim check --pp 2 replays the stages"])
    assert not out.exists()


# --- the packer (0.5.17+): a missing slot fails the forward -----------------------------------------

@pytest.mark.parametrize("release,error", [("0.5.17", "AssertionError"), ("0.5.19", "AssertionError"),
                                           ("0.5.20", "RuntimeError"), ("0.5.23", "RuntimeError")])
def test_the_packer_fails_where_the_loop_used_to_drop(release, error):
    p = lookup(f"sglang@{release}", "deepseek_v3")
    assert p.behaviour.out_of_range.value is OutOfRange.FAILS and p.behaviour.duplicates.value is Duplicates.FAILS
    assert p.behaviour.tbo.value is TboCapture.REGION_FAILS
    rep = replay(p, [2, 30, 61], 61)
    assert rep.failure.startswith(f"{error}: captured 2 of 3 aux hidden states") and rep.crashed
    assert [s.fate for s in rep.slots] == [Fate.CAPTURED, Fate.CAPTURED, Fate.FAILS]
    rep = replay(p, [2, 2, 30], 61)
    assert rep.failure.startswith(f"{error}: captured 2 of 3 aux hidden states") and "id 2 is a repeat" in rep.failure
    before = replay(lookup("sglang@0.5.16", "deepseek_v3"), [2, 30, 61], 61)
    assert before.failure is None and [s.fate for s in before.dropped] == [Fate.DROPPED]


def test_the_packer_with_nothing_captured_fails_the_unpack():
    rep = replay(lookup("sglang@0.5.23", "deepseek_v3"), [70, 80, 90], 61)
    assert rep.failure.startswith(UNPACK_TEXT) and "inferred from the code" in rep.failure


@example(release="0.5.17", ids=[3, 3])  # a repeat: the loop captures it once, the packer counts two
@example(release="0.5.23", ids=[-1])  # numbering keeps -1 as -1: never reached, nothing captured
@given(release=st.sampled_from(["0.5.17", "0.5.20", "0.5.23"]),
       ids=st.lists(st.integers(-2, 12), min_size=1, max_size=4))
def test_a_packing_engine_either_fills_every_slot_or_fails(release, ids):
    """The packer's invariant: the forward succeeds exactly when every id is captured once."""
    rep = replay(lookup(f"sglang@{release}", "deepseek_v3"), ids, 10)
    filled = len(rep.positions) == len(ids)
    assert (rep.failure is None) == filled and not rep.dropped
    if not filled and rep.positions:
        assert f"captured {len(rep.positions)} of {len(ids)} aux hidden states" in rep.failure


def test_other_model_files_keep_the_list_and_drop():
    for model in ("llama", "qwen3", "gpt_oss"):
        p = lookup("sglang@0.5.23", model)
        assert p.behaviour.out_of_range.value is OutOfRange.DROPPED, p.name


# --- DeepSeek-V2 vs V3: fusion auto-enable names DeepseekV3ForCausalLM only ----------------------------

FUSED = Served(tp=8, gpu=Gpu.H200)


@pytest.mark.parametrize("release", ["0.5.6", "0.5.7", "0.5.12", "0.5.14", "0.5.17", "0.5.23"])
def test_fusion_is_never_auto_enabled_for_deepseek_v2(release):
    v2 = lookup(f"sglang@{release}", "deepseek_v2")
    assert v2.family == "deepseek_v2" and v2.behaviour.fusion_auto.value is FusionAuto.NEVER
    assert "DeepseekV2ForCausalLM" in v2.behaviour.fusion_auto.source.note  # the rule read, V2 not on its list
    v3 = lookup(f"sglang@{release}", "deepseek_v3").behaviour.fusion_auto
    if release != "0.5.6":  # from 0.5.7 one rule lists the architectures: the same code, read for both
        assert v2.behaviour.fusion_auto.source.quote == v3.source.quote


@pytest.mark.parametrize("release,on", [("0.5.6", False), ("0.5.7", True), ("0.5.12", True), ("0.5.23", True)])
def test_fusion_on_an_h200_for_deepseek_v3_and_kimi(release, on):
    for model in ("deepseek_v3", "kimi_k2"):
        p = lookup(f"sglang@{release}", model)
        assert p.family == "deepseek_v3" and p.behaviour.fusion_auto.value.on(FUSED) is on, p.name


def test_the_tp_term_of_the_fusion_rule_is_0_5_10s():
    assert "tp_size" not in lookup("sglang@0.5.9", "deepseek_v3").behaviour.fusion_auto.source.quote
    assert lookup("sglang@0.5.9", "deepseek_v3").behaviour.fusion_auto.source.ref == "v0.5.8"
    assert "self.tp_size > 1" in lookup("sglang@0.5.10", "deepseek_v3").behaviour.fusion_auto.source.quote


# --- DeepEP, config, CP, in-layer capture, two-batch overlap ----------------------------------------

def test_deepep_gathers_over_the_tp_group_in_0_5_7_and_the_attention_tp_group_from_0_5_10():
    old, new = (lookup(f"sglang@{r}", "deepseek_v2").behaviour.scattered for r in ("0.5.9", "0.5.10"))
    assert old.value is new.value is Gather.GATHERED
    assert "tensor_model_parallel_all_gather(" in old.source.quote and old.source.ref == "v0.5.7"
    assert "get_attention_tp_group().all_gather(" in new.source.quote and new.source.ref == "v0.5.10"


def test_use_aux_hidden_state_is_read_from_0_5_8():
    assert lookup("sglang@0.5.7", "llama").behaviour.config.value.off_flag is None
    assert lookup("sglang@0.5.8", "llama").behaviour.config.value.off_flag == ("eagle_config", "use_aux_hidden_state")


def test_context_parallel_gathers_the_aux_states_on_every_path_from_0_5_20():
    cp = lookup("sglang@0.5.23", "deepseek_v3").behaviour.cp
    assert cp.value is Gather.GATHERED and cp.source.path.endswith("runner/eager_runner.py")


@pytest.mark.parametrize("model,release", [("llama", "0.5.22"), ("qwen3", "0.5.22"), ("gpt_oss", "0.5.21")])
def test_the_in_layer_capture_of_the_gqa_files(model, release):
    prev = f"0.5.{int(release.split('.')[-1]) - 1}"
    assert lookup(f"sglang@{prev}", model).behaviour.site.value is Site.BETWEEN_LAYERS
    b = lookup(f"sglang@{release}", model).behaviour
    assert b.site.value is Site.AFTER_FUSED_ADD and b.cloned.value and b.site.source.ref == f"v{release}"
    if model == "llama":  # id -1 lands before layer 0: a crash on the old loop, the embedding from 0.5.22
        assert replay(lookup("sglang@0.5.21", "llama"), [-1, 3], 8).crashed
        assert str(replay(lookup("sglang@0.5.22", "llama"), [-1, 3], 8).positions[0]) == "embed"


def test_two_batch_overlap_is_in_every_release_read():
    for release in sglang_server.READ:
        tbo = lookup(f"sglang@{release}", "deepseek_v3").behaviour.tbo
        packer = version_key(release) >= version_key("0.5.17")
        assert tbo.value is (TboCapture.REGION_FAILS if packer else TboCapture.REGION_NOT_CAPTURED), release
        assert packer or "elif self.first_k_dense_replace < normal_start_layer" in tbo.source.quote
    assert "releases not established" not in lookup("sglang@0.5.6", "deepseek_v3").behaviour.tbo.source.note


# quotes that change form inside their interval with the behaviour unchanged (docs/profiles.md names them):
# (family, field, the source's release)
KNOWN_FORM_CHANGES = {
    *((f, "cp", "v0.5.17") for f in ("deepseek_v2", "deepseek_v3")),  # read at 0.5.17 only: UNVERIFIED before
    *((f, "fusion_auto", "v0.5.19") for f in ("deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_moe")),
    *((f, "graphs", "v0.5.11") for f in ("deepseek_v2", "deepseek_v3", "gpt_oss", "llama", "qwen2", "qwen3_moe")),
    *((f, "fusion_auto", "v0.5.23") for f in ("llama", "qwen2")),
    *(("qwen3_moe", k, "v0.5.14") for k in ("site", "cloned", "embed", "order")),
}


@pytest.mark.parametrize("line", LINES, ids=lambda ln: ln.family)
def test_every_quote_holds_in_every_release_of_its_interval(line):
    """A source read at one release stands for its interval: the quoted lines are in the same function in every
    release between the change that brought it and the next (checked where the wheels are unpacked)."""
    read = sorted(sglang_server.READ, key=version_key)
    if body(read[-1], "python/sglang/srt/layers/aux_hidden_states.py", "AuxHiddenStatePacker") is None:
        no_sources(f"no unpacked sglang wheels under {WHEELS} (TPSIM_SGLANG_SRC)")
    missing = set()
    for p in line.profiles():
        lo = version_key(p.versions.since.release) if p.versions.since else version_key(read[0])
        hi = version_key(p.versions.until.release) if p.versions.until else None
        span = [v for v in read if version_key(v) >= lo and (hi is None or version_key(v) < hi)]
        for f in ("numbering", "defaults", "embed", "out_of_range", "order", "duplicates", "config", "site", "cloned",
                  "last_boundary", "graphs", "fusion_auto", "scattered", "pp", "tbo", "cp"):
            c = getattr(p.behaviour, f)
            if c is None or (line.family, f, c.source.ref) in KNOWN_FORM_CHANGES:
                continue
            for v in span:
                if " ".join(c.source.quote.split()) not in (body(v, c.source.path, c.source.symbol) or ""):
                    missing.add((p.name, f, v))
    assert not missing, sorted(missing)


# --- context parallel (issue 51 item 8): an environment variable picks the path, not the model config ---------

CP_ARCH = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@pytest.mark.parametrize("family", sorted(CP_ARCH))
@pytest.mark.parametrize("release", sglang_server.READ)
def test_cp_gather_names_the_environment_variable_where_it_decides(family, release):
    """0.5.18 .. 0.5.19: the eager runner's CP-v2 path all-gathers the aux states, the in-model CP-v1 path does
    not, and SGLANG_ENABLE_CP_V2 (default on for the architectures in CP_V2_DEFAULT_MODEL_CLASSES) picks one;
    before, both keep the rank's chunk; from 0.5.20 CP-v2 is the only path."""
    cp = lookup(f"sglang@{release}", family).behaviour.cp
    key = version_key(release)
    if key < version_key("0.5.18"):
        assert cp.value is Gather.LOCAL, cp
    elif key < version_key("0.5.20"):
        default_on = family == "deepseek_v3"
        assert cp.value is (Gather.GATHERED_UNLESS_CP_V2_OFF if default_on else Gather.GATHERED_IF_CP_V2), cp
        assert "SGLANG_ENABLE_CP_V2" in cp.value.value and "SGLANG_ENABLE_CP_V2" in cp.source.note
        listed = body(release, "python/sglang/srt/layers/cp/utils.py", "enable_cp_v2")
        if listed is None:
            no_sources(f"no unpacked sglang {release} wheel under {WHEELS} (TPSIM_SGLANG_SRC)")
        assert "envs.SGLANG_ENABLE_CP_V2.get()" in listed
        defaults = (WHEELS / f"sglang-{release}" / "sglang/srt/layers/cp/utils.py").read_text()
        table = defaults.split("CP_V2_DEFAULT_MODEL_CLASSES = frozenset(", 1)[1].split(")", 1)[0]
        assert (f'"{CP_ARCH[family]}"' in table) is default_on, table
    else:
        assert cp.value is Gather.GATHERED, cp
