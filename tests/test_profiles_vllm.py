"""vLLM and SpecForge profiles as the released code has them (issue 34): pipeline parallelism per
release (stage-local numbering up to 0.29.0, then handoff or the start-up refusal), the model
runner that serves and the config keys it reads, the DeepSeek capture's gather, 0.34.0 and the
SpecForge releases; every source names its symbol and quotes the code read; check, capture and
triage replay the refusal and write nothing."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from clirun import run_clis
from tpsim.base.errors import UsageError
from tpsim.capture import Position, PositionKind
from tpsim.capture.pipeline import Handoff, numbered_on
from tpsim.parallel.pipeline import Split, stages
from tpsim.profiles import trainers, vllm
from tpsim.profiles.draft import read_ids
from tpsim.profiles.fingerprints import Status, classify_line
from tpsim.profiles.cited import Cited
from tpsim.profiles.profile import Behaviour, Gather, Order, Site
from tpsim.profiles.registry import lookup
from tpsim.profiles.replay import replay


def pp(spec: str, model: str = "deepseek_v2") -> Cited:
    return lookup(spec, model).behaviour.pp


# --- pipeline parallelism, per release ---------------------------------------------------------------

@pytest.mark.parametrize("spec,handoff", [
    ("vllm@0.24.0:deepseek_v2", Handoff.LAST_STAGE_ONLY),  # runner v1 under PP; the model file returns early
    ("vllm@0.29.0:deepseek_v3", Handoff.LAST_STAGE_ONLY),
    ("vllm@0.29.0:llama", Handoff.STAGE_LOCAL),  # llama.py: enumerate without start=
    ("vllm@0.18.0:llama", Handoff.STAGE_LOCAL),
    ("vllm@0.29.0:minimax_m2", Handoff.STAGE_LOCAL),
    ("vllm@0.29.0:qwen3_moe", Handoff.LAST_STAGE_ONLY),  # numbered from start_layer already
    ("vllm@0.30.0:llama", Handoff.HANDOFF),  # supports_aux_hidden_states_over_pp = True
    ("vllm@0.33.0:llama", Handoff.HANDOFF),
    ("vllm@0.30.0:deepseek_v2", Handoff.REFUSED),
    ("vllm@0.33.0:deepseek_v3", Handoff.REFUSED),
    ("vllm@0.34.0:qwen3_moe", Handoff.REFUSED),
    ("vllm:minimax_m2", Handoff.REFUSED),
])
def test_pp_behaviour_per_release(spec, handoff):
    assert pp(spec).value is handoff


def test_the_refusal_is_the_engines_own_text():
    """The error formats as the quoted f-string does, with the served model's class and method eagle3."""
    c = pp("vllm@0.33.0:deepseek_v2")
    quote = c.source.quote
    parts = re.findall(r'f?"([^"]*)"', quote[quote.index("raise ValueError("):])
    template = "".join(parts).replace("{type(model).__name__}", "{architecture}").replace("{method}", "eagle3")
    assert c.error.replace("{architecture}", "DeepseekV2ForCausalLM") == "ValueError: " + template.replace(
        "{architecture}", "DeepseekV2ForCausalLM")
    assert c.source.symbol == "verify_supports_aux_hidden_states_over_pp" and c.source.ref == "v0.30.0"


@st.composite
def pp_runs(draw):
    L = draw(st.integers(2, 64), label="L")
    size = draw(st.integers(2, min(L, 8)), label="pp")
    ids = draw(st.lists(st.integers(0, L + 2), min_size=1, max_size=4, unique=True), label="ids")
    return L, size, sorted(ids)


def engine_last_stage(ids: list[int], start: int, end: int, local: bool) -> list[int]:
    """The boundaries llama.py's last stage captures: `_maybe_add_hidden_state` with 0 (v0.18.0 .. v0.29.0) or
    start_layer (v0.30.0) before the loop and idx + 1 after each layer, idx from 0 or from start_layer."""
    first = 0 if local else start
    tested = [first] + [(k if local else start + k) + 1 for k in range(end - start)]
    return [start + (t - first) for t in tested if t in ids]


@example(c=(8, 2, [2, 4, 6]))  # the scenario: out(5), out(7); 6 matches nothing
@example(c=(61, 4, [2, 30, 58]))
@given(c=pp_runs())
def test_stage_local_numbering_is_the_loop_as_released(c):
    """numbered_on (what tpsim replays under STAGE_LOCAL) equals the last stage's loop of llama.py as quoted."""
    L, size, ids = c
    last = stages(L, size, 1, Split.VLLM)[-1]
    want = engine_last_stage(ids, last.start, last.end, local=True)
    got = [numbered_on(Position.at_boundary(b), last) for b in ids]
    assert sorted(q.boundary for q in got if q is not None) == want
    assert "enumerate( islice(self.layers, self.start_layer, self.end_layer) ):" in pp("vllm@0.29.0:llama").source.quote


def test_check_pp_replays_stage_local_numbering():
    r = run_clis({"k": ["check", "--pp", "2", "--tp", "1", "--server", "vllm@0.25.0:llama", "--model", "tiny-llama", "--layers", "2,4,6",
                        "--seq-len", "4", "--json"]})["k"]
    assert r.returncode == 1, r
    got = json.loads(r.stdout)
    assert got["convention"]["positions"] == ["out(5)", "out(7)"]
    assert any("numbers its layers from 0, and captures out(5)" in f for f in got["convention"]["findings"])


# --- the model runner and the keys it reads ----------------------------------------------------------

RAW = {"nested": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}},
       "dspark": {"dspark_target_layer_ids": [3, 7, 11]}, "target": {"target_layer_ids": [3, 7, 11]},
       "eagle-layer-ids": {"eagle_config": {"layer_ids": [3, 7, 11]}},
       "dflash-layer-ids": {"dflash_config": {"layer_ids": [3, 7, 11]}},
       "dflash-first": {"dflash_config": {"target_layer_ids": [3, 7, 11], "layer_ids": [5, 9, 13]}},
       "dflash-target": {"dflash_config": {"target_layer_ids": [3, 7, 11]}}}
KEYS = {  # (profile, config) -> ids read (None: the default), each from the eagle3_utils.py / runner v1 release
    ("vllm@0.18.0:llama", "nested"): None,  # runner v1 reads the top-level key only up to 0.19.1
    ("vllm@0.19.1:deepseek_v3", "nested"): None,
    ("vllm@0.19.1:qwen3_moe", "dflash-target"): None,
    ("vllm@0.20.0:deepseek_v2", "dflash-target"): [3, 7, 11],  # 0.20.0: dflash target ids as written
    ("vllm@0.21.0:qwen3_moe", "nested"): None,
    ("vllm@0.22.0:deepseek_v3", "nested"): [1, 29, 57],  # 0.22.0: the nested key
    ("vllm@0.22.0:qwen3_moe", "dflash-target"): [4, 8, 12],  # and dflash + 1
    ("vllm@0.23.0:deepseek_v2", "nested"): [1, 29, 57],  # not on runner v2's list before 0.24.0
    ("vllm@0.23.0:llama", "nested"): None,  # Llama on runner v2 from 0.23.0: the top-level key only
    ("vllm@0.23.0:llama", "dflash-target"): None,
    ("vllm@0.24.0:llama", "dflash-target"): [4, 8, 12],
    ("vllm@0.24.0:deepseek_v2", "dspark"): None,
    ("vllm@0.25.0:deepseek_v2", "dspark"): [4, 8, 12],  # + 1
    ("vllm@0.25.0:deepseek_v2", "target"): [4, 8, 12],
    ("vllm@0.26.0:llama", "eagle-layer-ids"): None,
    ("vllm@0.27.0:llama", "eagle-layer-ids"): [3, 7, 11],  # as written
    ("vllm@0.27.0:llama", "dflash-layer-ids"): [3, 7, 11],
    ("vllm@0.27.0:llama", "dflash-first"): [4, 8, 12],  # target_layer_ids + 1 before layer_ids
    ("vllm@0.28.0:deepseek_v3", "nested"): [1, 29, 57],  # runner v1 (MoE, not on the list)
    ("vllm@0.28.0:qwen3_moe", "nested"): [1, 29, 57],
    ("vllm@0.29.0:deepseek_v3", "nested"): None,  # runner v2 for every model
    ("vllm@0.29.0:qwen3_moe", "nested"): None,
    ("vllm@0.34.0:deepseek_v3", "eagle-layer-ids"): [3, 7, 11],
}


@pytest.mark.parametrize("case", sorted(KEYS), ids=str)
def test_runner_reads_the_keys_of_its_release(case):
    spec, raw = case
    assert read_ids(lookup(spec, "deepseek_v2"), RAW[raw]).ids == KEYS[case]


def test_nested_key_reader_is_runner_v1_and_gone_by_0_34():
    for spec in ("vllm@0.28.0:deepseek_v3", "vllm@0.24.0:qwen3_moe"):
        assert lookup(spec, "x").behaviour.config.source.path == vllm.MRV1
    for spec in ("vllm@0.29.0:deepseek_v3", "vllm@0.34.0:qwen3_moe", "vllm@0.34.0:minimax_m2"):
        src = lookup(spec, "x").behaviour.config.source
        assert src.path != vllm.MRV1 and "VllmConfig.use_v2_model_runner" == src.symbol


def test_minimax_m2_captures_from_0_20_0():
    """0.18.0 and 0.19.x: MiniMaxM2ForCausalLM is not SupportsEagle3 (runner v1 raises); 0.20.0 puts MiniMaxM2Model on
    EagleModelMixin."""
    with pytest.raises(UsageError, match=r"is profiled for 0.20.0 \.\. 0.34.0.*0.19.1 is older"):
        lookup("vllm@0.19.1:minimax_m2", "x")
    p = lookup("vllm@0.20.0:minimax_m2", "x")
    assert p.behaviour.pp.source.ref == "v0.20.0" and p.behaviour.config.value.keys[1].path == ("dflash_config",
                                                                                                   "target_layer_ids")


@pytest.mark.parametrize("line", vllm.LINES, ids=lambda ln: ln.family)
def test_every_vllm_release_is_read_or_unchanged_since(line):
    """Each cited symbol's code at every release of the line was read (READ) or equals code read (SAME)."""
    got = {c.release: c.status for c in classify_line(line)}
    assert got and set(got.values()) <= {Status.READ, Status.SAME}, {r: s for r, s in got.items()
                                                                     if s not in (Status.READ, Status.SAME)}


# --- DeepSeek's capture under a token-short stream, order, 0.34.0 --------------------------------------

def test_deepseek_gather_starts_at_0_25():
    assert lookup("vllm@0.24.0", "deepseek_v3").behaviour.scattered.value is Gather.WHOLE
    assert "tensor_model_parallel_all_gather" in lookup("vllm@0.24.0", "deepseek_v3").behaviour.scattered.source.quote
    assert lookup("vllm@0.25.0", "deepseek_v3").behaviour.scattered.value is Gather.GATHERED


def test_mixin_sorts_and_deduplicates_from_0_30():
    old, new = (lookup(s, "llama").behaviour for s in ("vllm@0.29.0", "vllm@0.30.0"))
    assert old.order.value is new.order.value is Order.ASCENDING
    assert "sorted(set(layers))" in new.order.source.quote and "sorted" not in old.order.source.quote
    assert replay(lookup("vllm@0.30.0", "llama"), [5, 5, 2], 32).positions == [Position(PositionKind.OUT, 1),
                                                                               Position(PositionKind.OUT, 4)]


def test_0_34_0_is_known():
    assert "0.34.0" in vllm.RELEASES and lookup("vllm@0.34.0", "deepseek_v3").name == "vllm@0.30.0:deepseek_v3"


# --- SpecForge releases ------------------------------------------------------------------------------

def test_specforge_releases_resolve():
    p = lookup("specforge@0.1.0", "llama")
    assert p.behaviour.config.value.hard_coded and "low_aux_layer = 1 + offset" in p.behaviour.numbering.source.quote
    assert [str(q) for q in replay(p, [5, 6, 7], 32).positions] == ["out(1)", "out(15)", "out(28)"]
    q = lookup("specforge@0.2.0", "deepseek_v3")  # the SGLang backend, through sglang 0.5.14 (0.2.0 pins it)
    assert q.name == "specforge@2026-07-14:deepseek_v2" and q.behaviour.numbering.source.ref == "v0.5.14"
    assert lookup("specforge@2026-07-01", "llama").name == "specforge@2025-09-01:any"  # dates keep working


def test_specforge_server_backend_captures_where_sglang_does():
    """0.2.0 has no HF hooks: site and cloned are SGLang 0.5.14's (deepseek_v2.py: in the decoder layer, cloned)."""
    ds, llama = (lookup("specforge@0.2.0", m).behaviour for m in ("deepseek_v3", "llama"))
    assert (ds.site.value, ds.cloned.value) == (Site.AFTER_FUSED_ADD, True)
    assert (ds.site.value, ds.cloned.value) == (lookup("sglang@0.5.14", "deepseek_v2").behaviour.site.value, True)
    assert (llama.site.value, llama.cloned.value) == (Site.BETWEEN_LAYERS, False)
    assert "hf_capture" not in ds.site.source.symbol + llama.cloned.source.symbol


# --- every source is evidence ------------------------------------------------------------------------

def cited_sources(lines) -> list:
    out = []
    for line in lines:
        for b in [line.base] + [c.changes for c in (line.starts, *line.changes) if c is not None]:
            values = [getattr(b, f) for f in Behaviour.FIELDS] if isinstance(b, Behaviour) else list(b.values())
            out += [c.source for c in values if c is not None]
    return out


@pytest.mark.parametrize("source", sorted(set(cited_sources(vllm.LINES + trainers.LINES)), key=str), ids=str)
def test_every_source_names_its_symbol_and_quotes_it(source):
    assert source.path and not source.ref.startswith("#"), source
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", source.symbol), source
    assert source.quote and source.quote == " ".join(source.quote.split()) and len(source.quote) >= 20, source


# --- check, capture and triage replay the refusal ----------------------------------------------------

def test_pp_refusal_is_replayed_and_nothing_written(tmp_path):
    out = tmp_path / "cap.safetensors"
    spec = ["--server", "vllm@0.33.0:deepseek_v2", "--pp", "2", "--tp", "1"]
    runs = run_clis({"check": ["check", *spec, "--seq-len", "4"], "capture": ["capture", *spec, "--out", str(out)],
                     "triage": ["triage", *spec, "--draft-config", "configs/scenarios/align-default-fallback.json", "--model", "deepseek-v3",
                                "--json"]})
    text = "ValueError: DeepseekV2ForCausalLM does not support eagle3 with pipeline parallelism"
    assert runs["check"].returncode == 1 and text in runs["check"].stdout, runs["check"]
    assert "refuses --pp 2 with an EAGLE-3 draft at start-up" in runs["check"].stdout, runs["check"]
    assert "said so from 0.30.0" in runs["check"].stdout, runs["check"]
    assert runs["capture"].returncode == 1 and text in runs["capture"].stderr and not out.exists(), runs["capture"]
    assert "nothing written" in runs["capture"].stderr
    t = runs["triage"]
    assert t.returncode == 1, t
    (f,) = json.loads(t.stdout)["findings"]
    v3 = text.replace("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")  # the draft's 7168 wide: triaged on DeepSeek-V3
    assert f["kind"] == "engine-refuses" and v3 in f["cause"] and json.loads(t.stdout)["check"] is None
