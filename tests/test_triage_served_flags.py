"""triage's findings from served flags whose behaviour lives outside the model files (tpsim/app/served_flags.py):
SGLang's radix cache (on unless --disable-radix-cache; keyed by tokens up to 0.5.2) and the PD hand-off under
--disaggregation-mode (sglang PRs #9976 and #13590). A version before the model files read is captured as the
oldest read one's; a behaviour not read for a version is UNVERIFIED, not judged."""

from __future__ import annotations

import json

from hypothesis import example, given, strategies as st

from clirun import assert_one_line_error, run_cli
from tpsim.app.served_flags import pd_findings, radix_findings, ubatch_findings, unread_notes
from tpsim.profiles.findings import Kind
from tpsim.profiles.pd import Widths
from tpsim.profiles.pd_versions import PD
from tpsim.profiles.profile import Served
from tpsim.profiles.registry import lookup
from tpsim.config.loader import BUILTIN_CONFIGS

DRAFT = str(BUILTIN_CONFIGS / "scenarios" / "tiny-draft-nested-ids.json")
VERSIONS = ["0.5.1", "0.5.2", "0.5.3", "0.5.5", "0.5.6", "0.5.12", "0.5.23"]
SERVE = lookup("sglang@0.5.6:deepseek_v2", "deepseek_v2")


@given(version=st.sampled_from(VERSIONS), radix=st.booleans(), pd=st.booleans(),
       draft=st.sampled_from([32, 64, 128]), slots=st.integers(1, 5))
def test_each_flag_is_judged_where_read_and_only_when_on(version, radix, pd, draft, slots):
    served = Served(radix_cache=radix, disaggregated=pd, server=f"sglang@{version}")
    r, p = radix_findings(SERVE, served), pd_findings(SERVE, served, 64, draft, slots)
    notes = unread_notes(SERVE, served)
    assert [f.kind for f in r] == ([Kind.PREFIX_CACHE] if radix and version == "0.5.2" else [])
    assert (version == "0.5.1" and radix) == any("radix cache" in n for n in notes)
    fits = pd and PD.at(f"sglang@{version}").value.fits(Widths(64, draft, slots))
    assert [f.kind for f in p] == ([Kind.PD_HANDOFF] if pd and not fits else [])
    for f in r + p:
        assert f.sources and "serve with sglang" in f.fix


def test_triage_names_the_flags_and_replays_the_fix():
    r = run_cli("triage", "--server", "sglang@0.5.2", "--draft-config", DRAFT, "--model", "tiny", "--json")
    out = json.loads(r.stdout)
    kinds = {f["kind"]: f for f in out["findings"]}
    assert r.returncode == 1 and kinds["prefix-cache"]["fix_replayed"], out["findings"]
    assert out["server"] == "sglang@0.5.2" and out["serve_profile"] == "sglang@0.5.6:deepseek_v2"
    off = run_cli("triage", "--server", "sglang@0.5.2", "--draft-config", DRAFT, "--model", "tiny", "--json",
                  "--disable-radix-cache")
    assert "prefix-cache" not in {f["kind"] for f in json.loads(off.stdout)["findings"]}, off.stdout


def test_the_flags_are_sglangs():
    r = run_cli("triage", "--server", "vllm@0.34.0", "--draft-config", DRAFT, "--model", "tiny-llama",
                "--disable-radix-cache")
    assert_one_line_error(r, "--disable-radix-cache applies only with an SGLang --server")


@given(version=st.sampled_from(["0.18.0", "0.20.0", "0.21.0", "0.22.0", "0.27.0", "0.33.0", "0.34.0"]),
       dbo=st.booleans())
@example(version="0.25.0", dbo=True)  # issue 51, item 1: "nothing found" here, and 0.22.0 named as the fix
def test_dbo_fails_up_to_0_33_and_merges_from_0_34(version, dbo):
    """--enable-dbo with EAGLE-3: up to 0.21.0 the micro-batches' (hidden, aux) outputs meet torch.cat as tensors
    (issue #40769); 0.22.0 (PR #40789) to 0.33.0 concatenate each tuple component, and the aux component is a list
    ("but got list"); 0.34.0's merge_ubatch_outputs recurses into lists: the fix names 0.34.0."""
    serve = lookup(f"vllm@{version}:qwen3_moe", "qwen3_moe")
    found = ubatch_findings(serve, Served(dbo=dbo, server=f"vllm@{version}"))
    old = version != "0.34.0"
    assert [f.kind for f in found] == ([Kind.UBATCH_MERGE] if dbo and old else [])
    tuples = version in ("0.18.0", "0.20.0", "0.21.0")
    assert all(("but got tuple" if tuples else "but got list") in f.cause and "0.34.0" in f.fix for f in found)


def test_the_dbo_fix_and_the_plan_name_0_34_0_and_hold_as_applied():
    r = run_cli("triage", "--draft-config", "ids-at-top-level", "--server", "vllm@0.25.0:deepseek_v3", "--tp", "2",
                "--enable-dbo", "--json")
    rep = json.loads(r.stdout)
    dbo = next(f for f in rep["findings"] if f["kind"] == "ubatch-merge")
    assert dbo["fix_replayed"] and dbo["change"]["server"] == "vllm@0.34.0:deepseek_v3", dbo
    assert rep["plan"]["clears"] and rep["plan"]["change"]["server"] == "vllm@0.34.0:deepseek_v3", rep["plan"]


def test_enable_dbo_is_vllms():
    r = run_cli("triage", "--server", "sglang@0.5.12", "--draft-config", DRAFT, "--model", "tiny", "--enable-dbo")
    assert_one_line_error(r, "--enable-dbo applies only with a vLLM --server")


def test_a_version_before_the_model_files_is_captured_as_the_oldest_read_one():
    from tpsim.profiles.history import model_file_server
    for given, served in (("sglang@0.5.2", "sglang@0.5.6"), ("sglang@0.5.2+embed", "sglang@0.5.6+embed"),
                          ("sglang@0.5.1:deepseek_v2", "sglang@0.5.6:deepseek_v2"),
                          ("sglang@0.5.12+embed", "sglang@0.5.12+embed"), ("vllm@0.17.1", "vllm@0.17.1"),
                          ("sglang", "sglang")):
        got, note = model_file_server(given, "the radix cache")
        assert got == served and (note is None) == (got == given), (given, got, note)
