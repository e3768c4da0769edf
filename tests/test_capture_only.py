"""SGLang 0.5.23's capture-only mode (issue 51 item 9): `--enable-return-aux-hidden-states` with
`--return-aux-hidden-state-layer-ids`, replayed by `tpsim resolve --server sglang@V --enable-return-aux-hidden-states`.
The start-up checks are compared with the released functions themselves, run on drawn ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from clirun import assert_one_line_error, run_clis
from sglang_src import WHEELS, body, no_sources, released_function
from tpsim.profiles import sglang_server
from tpsim.profiles.capture_only import CAPTURE_ONLY, CHECKED_0523, NOT_IN_0522, CaptureOnly, served, startup_refusal
from tpsim.profiles.registry import lookup, version_key
from tpsim.profiles.replay import replay

CHECKS, RANGE = "arg_groups/validation_hook.py", "model_executor/model_runner_components/spec_aux_hidden_state.py"


def released_refusal(ids: list[int] | None, L: int) -> str | None:
    """SGLang 0.5.23's own checks on the ids: the start-up hook, then the range check the model runner makes."""
    hook = released_function("0.5.23", CHECKS, "handle_aux_hidden_state_capture",
                             resolving_view=lambda args: args, declare_resolution=lambda *a, **k: None,
                             _AUX_HIDDEN_STATE_CAPTURE_METHODS=("EAGLE3", "DFLASH", "DSPARK"))
    in_range = released_function("0.5.23", RANGE, "_check_capture_layer_ids_in_range")
    args = SimpleNamespace(enable_return_aux_hidden_states=True, return_aux_hidden_state_layer_ids=ids,
                           speculative_algorithm="EAGLE3", speculative_draft_model_path=None, pp_size=1)
    try:
        hook(args)
        if ids is not None:
            in_range(ids, SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=L)))
    except ValueError as e:
        return f"ValueError: {e}"
    return None


@given(st.one_of(st.none(), st.lists(st.integers(-3, 70), max_size=5)), st.integers(1, 64))
@example([], 8)
@example([1, 1, 5], 8)
@example([-1, 3, 5], 8)
@example([1, 3, 8], 8)
def test_the_startup_checks_refuse_what_the_released_code_refuses_in_its_words(ids, L):
    assert startup_refusal(ids, L) == released_refusal(ids, L)


@pytest.mark.parametrize("release", sglang_server.READ)
def test_the_mode_is_in_0_5_23_only(release):
    """No source file of a release before 0.5.23 names the flag; 0.5.23 checks the ids at start-up."""
    srt = WHEELS / f"sglang-{release}" / "sglang/srt"
    if not srt.is_dir():
        no_sources(f"no unpacked sglang {release} wheel under {WHEELS} (TPSIM_SGLANG_SRC)")
    named = any("enable_return_aux_hidden_states" in f.read_text() for f in srt.rglob("*.py"))
    assert CAPTURE_ONLY.at(f"sglang@{release}").value.served is named is (version_key(release) >= version_key("0.5.23"))
    for c in (NOT_IN_0522, CHECKED_0523.changes["capture_only"]):
        s = c.source
        assert " ".join(s.quote.split()) in body(s.ref[1:], s.path, s.symbol), s


@given(st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True),
       st.sampled_from(["llama", "qwen2", "deepseek_v3", "gpt_oss", "qwen3_moe"]))
def test_ids_the_server_takes_are_replayed_as_a_drafts_ids(ids, model):
    """What starts is captured as the model file captures a draft's ids; what is refused is refused before."""
    L = 32
    why = served(f"sglang@0.5.23:{model}", ids, L)
    assert (why is None) == (startup_refusal(ids, L) is None)
    if why is None:
        rep = replay(lookup("sglang@0.5.23", model), ids, L)
        assert rep.ids == ids
    else:
        assert why.startswith(f"sglang@0.5.23:{model} refuses to start: ValueError: ")


def test_resolve_says_what_the_server_does():
    base = ["resolve", "--enable-return-aux-hidden-states", "--num-layers", "32"]
    runs = run_clis({
        "passes_then_misses": [*base, "--server", "sglang@0.5.23:llama", "--layers", "1,15,31"],
        "refused": [*base, "--server", "sglang@0.5.23:llama", "--layers", "1,15,32"],
        "too_old": [*base, "--server", "sglang@0.5.22:llama", "--layers", "1,15,30"],
        "default": [*base, "--server", "sglang@0.5.23:llama"],
        "vllm": [*base, "--server", "vllm@0.34.0", "--layers", "1,15,30"],
        "convention": [*base, "--convention", "vllm-ids", "--layers", "1,15,30"],
    })
    r = runs["passes_then_misses"]  # 31 < 32 passes the check; the llama setter's +1 makes it 32: never reached
    assert r.returncode == 1 and "id 31 becomes internal id 32" in r.stdout, r
    r = runs["refused"]
    assert r.returncode == 1 and ("FAIL: sglang@0.5.23:llama refuses to start: ValueError: "
                                  "--return-aux-hidden-state-layer-ids [32] out of range for a target with 32 layers."
                                  in r.stdout), r
    r = runs["too_old"]
    assert r.returncode == 1 and "unknown argument (first in sglang 0.5.23)" in r.stdout, r
    r = runs["default"]
    assert r.returncode == 0 and "the model's EAGLE-3 default" in r.stdout and CaptureOnly.IDS_CHECKED.served, r
    assert_one_line_error(runs["vllm"], ["of sglang only"])
    assert_one_line_error(runs["convention"], ["give --server sglang@VERSION"])
