"""Issue 51: the advice `tpsim draft --server` prints holds in the release it names, read from that release's code
(each behaviour quoted in tpsim/profiles/loader_lines.py), and every fix, applied as a user would, clears its finding
in a replay of that release.

- vLLM builds fc for exactly three aux states up to 0.21.0 (`fc_input_size = self.config.target_hidden_size * 3`);
  0.22.0 reads num_aux_hidden_states: a five-state draft is refused by 0.21.0, not by 0.22.0.
- A draft with norm_before_fc only under eagle_config: vLLM reads that key from 0.22.0, not 0.18.0.
- SGLang's LlamaForCausalLM.set_embed (the EAGLE-3 draft inherits it, 0.5.6 to 0.5.23) returns early when the
  draft config's target_hidden_size is not its hidden_size: such a draft runs on its own embed_tokens."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import example, given, settings, strategies as st

from test_draft_checkpoint import CONFIG
from test_draft_loaders import TINY, drafted, served
from tpsim.app.draft_served import served_findings
from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.profiles.loader_lines import lookup

FIVE = {**CONFIG, "num_aux_hidden_states": 5, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4, 5]}}


@pytest.mark.parametrize("server,refused", [("vllm@0.11.0", True), ("vllm@0.21.0", True), ("vllm@0.22.0", False),
                                            ("vllm@0.34.0", False)])
def test_vllm_sizes_fc_from_the_config_from_0_22_0(tmp_path, server, refused):
    _, out = served(drafted(tmp_path, FIVE), server)
    fc = [f for f in out["findings"] if f["key"] == "fc.weight"]
    assert bool(fc) == refused, out
    if refused:
        assert "5 x 16" in fc[0]["cause"] and "serve with vllm 0.22.0 or later, which reads" in fc[0]["fix"], fc
        assert "llama_eagle3.py @v0.21.0" in fc[0]["source"], fc


def alone(raw: dict) -> DraftCheckpoint:
    return DraftCheckpoint(None, DraftConfig.from_json(raw), {}, raw=raw, weights=False)


def norms(raw: dict, server: str) -> list:
    return [f for f in served_findings(alone(raw), [], [lookup(server)], None) if f.defect is DraftDefect.NORM_IGNORED]


def user_applies(raw: dict, fix: str, server: str) -> list[tuple[dict, str]]:
    """Each way out the fix offers, as the user takes it: (the config, the server)."""
    out = []
    nested_on = {**raw, "eagle_config": {**raw.get("eagle_config", {}), "norm_before_fc": True}}
    m = re.search(r"serve with (sglang|vllm) ([\d.]+) or later", fix)
    if m:
        out.append((nested_on if ', and write "eagle_config"' in fix else raw, f"{m.group(1)}@{m.group(2)}"))
    if fix.startswith('write "eagle_config": {"norm_before_fc": true}'):
        out.append((nested_on, server))
    if 'write "norm_before_fc": true at the top level' in fix:
        v = re.search(r"at the top level too for (?:vllm|sglang) ([\d.]+) or later", fix)
        out.append(({**raw, "norm_before_fc": True}, f"{server.partition('@')[0]}@{v.group(1)}" if v else server))
    return out


RELEASES = ["vllm@0.11.0", "vllm@0.17.1", "vllm@0.18.0", "vllm@0.21.0", "vllm@0.22.0", "vllm@0.34.0",
            "sglang@0.5.6", "sglang@0.5.16", "sglang@0.5.17", "sglang@0.5.23"]


def test_every_norm_fix_applied_as_printed_clears_it_in_the_release_it_names():
    """Every placement of norm_before_fc (absent, true, false; top level and under eagle_config), with fc_norm and
    norm_output, on releases either side of each change: each way out a fix offers, taken as printed, clears it in the
    release it names (the audit's case: nested only on vLLM 0.17.1, whose fix named 0.18.0)."""
    for top, nested, other in itertools.product([None, True, False], [None, True, False], [{}, {"fc_norm": True},
                                                                                           {"norm_output": True}]):
        raw = {**CONFIG, **other, **({} if top is None else {"norm_before_fc": top}),
               **({} if nested is None else {"eagle_config": {"norm_before_fc": nested}})}
        for server in RELEASES:
            for f in norms(raw, server):
                ways = user_applies(raw, f.fix, server)
                assert ways, f.fix
                for changed, release in ways:
                    assert [g for g in norms(changed, release) if g.key == f.key] == [], (f.fix, release, changed)


def test_sglang_runs_a_wider_target_drafts_own_embedding(tmp_path):
    """target_hidden_size 64 (tiny's) and hidden_size 16: set_embed returns early, the draft keeps its own
    embed_tokens; without one it runs on an uninitialised embedding (embed-absent); the same widths share it."""
    wide = {**CONFIG, "target_hidden_size": 64, "vocab_size": 1000}
    _, out = served(drafted(tmp_path, wide, lambda t: t.pop("embed_tokens.weight"), name="none"), "sglang@0.5.12",
                    model="tiny")
    found = [f for f in out["findings"] if f["key"] == "embed_tokens.weight"]
    assert [f["defect"] for f in found] == ["embed-absent"], out
    assert "target_hidden_size is not its hidden_size" in found[0]["cause"], found
    assert "models/llama.py @v0.5.6" in found[0]["source"], found
    _, same = served(drafted(tmp_path, TINY, lambda t: t.pop("embed_tokens.weight"), name="same"), "sglang@0.5.12",
                     model="tiny")
    assert [f for f in same["findings"] if f["key"] == "embed_tokens.weight"] == [], same


SERVERS = ["sglang@0.5.6:deepseek_v3", "sglang@0.5.12:deepseek_v3", "sglang@0.5.20:deepseek_v3", "sglang@0.5.12:llama",
           "sglang@0.5.23:deepseek_v2"]


@settings(max_examples=15, deadline=None)
@given(ids=st.lists(st.integers(-1, 62), min_size=3, max_size=3), server=st.sampled_from(SERVERS))
@example(ids=[2, 30, 61], server="sglang@0.5.20:deepseek_v3")  # the audit's: a packer failure, no embedding
@example(ids=[-1, 2, 30], server="sglang@0.5.12:deepseek_v3")  # the embedding crash: the hint holds
def test_a_patched_replay_hint_only_for_the_embedding_crash_and_one_tpsim_takes(ids, server):
    from clirun import run_cli
    r = run_cli("resolve", "--server", server, "--layers", ",".join(map(str, ids)), "--num-layers", "61")
    hint = re.search(r"replay it with --server (\S+?);", r.stdout + r.stderr)
    if hint is None:
        assert "+embed" not in r.stdout + r.stderr or "residual is still None" in r.stdout + r.stderr, r
        return
    assert "residual is still None" in r.stdout + r.stderr, r  # the crash the patch is for, not a packer's count
    again = run_cli("resolve", "--server", hint.group(1), "--layers", ",".join(map(str, ids)), "--num-layers", "61")
    assert again.returncode in (0, 1), again  # a profile tpsim accepts


def test_the_radix_fix_names_the_first_fixed_release_and_its_pr():
    """Issue 51, item 5: SGLang keys the radix tree by token pairs under EAGLE from 0.5.3 (PR #10846); the fix named
    0.5.6, the first model file tpsim read, and no PR. Served as 0.5.3, the capture replays 0.5.6's model file."""
    import json
    from clirun import run_cli
    r = run_cli("triage", "--draft-config", "ids-at-top-level", "--server", "sglang@0.5.2:deepseek_v3", "--tp", "2",
                "--json")
    radix = next(f for f in json.loads(r.stdout)["findings"] if f["kind"] == "prefix-cache")
    assert radix["fix"].startswith("serve with sglang@0.5.3 or later (#10846)") and radix["fix_replayed"], radix
    assert radix["change"]["server"] == "sglang@0.5.3:deepseek_v3", radix


def test_a_remedy_search_goes_past_an_upgrade_that_refuses(tmp_path):
    """Issue 51, item 4: Qwen3.5 on vllm@0.17.1 captures nothing; triage tried only 0.18.0, whose start-up refuses the
    launch, and said no fix clears it. Each later version that wires the capture otherwise is replayed: 0.20.0."""
    import json
    from clirun import run_cli
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "eagle_aux_hidden_state_layer_ids": [1, 15,
                                                                                                           28]}))
    r = run_cli("triage", "--draft-config", str(tmp_path / "config.json"), "--server", "vllm@0.17.1", "--model",
                "qwen3.5-9b", "--tp", "2", "--json")
    rep = json.loads(r.stdout)
    f = next(f for f in rep["findings"] if f["kind"] == "capture-ignored")
    assert f["fix_replayed"] and f["change"]["server"].startswith("vllm@0.20.0"), f
    assert rep["plan"]["clears"], rep["plan"]


def test_minimax_m2_before_0_20_is_refused_where_each_release_refuses_it():
    """Issue 51, item 8: vLLM 0.18.0 and 0.19.0 refuse MiniMax-M2 in SpeculativeConfig (minimax_m2 is not in
    `aux_hidden_states_supported`, read from the wheels); only 0.19.1 reaches the runner's RuntimeError."""
    from tpsim.profiles.vllm import MINIMAX_M2
    note = next(n for n in MINIMAX_M2.notes if n.startswith("0.18.0 and 0.19.0"))
    assert "ValueError: eagle3 is only supported for [...] models" in note and "0.19.1 adds minimax_m2" in note
    assert note.index("ValueError") < note.index("RuntimeError: Model does not support EAGLE3 interface")
