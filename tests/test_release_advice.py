"""Issue 51: the advice `tpsim draft --server` prints holds in the release it names, read from that release's code
(each behaviour quoted in tpsim/profiles/loader_lines.py), and every fix, applied as a user would, clears its finding
in a replay of that release.

- vLLM builds fc for exactly three aux states up to 0.21.0 (`fc_input_size = self.config.target_hidden_size * 3`);
  0.22.0 reads num_aux_hidden_states: a five-state draft is refused by 0.21.0, not by 0.22.0.
- A draft with norm_before_fc only under eagle_config: vLLM reads that key from 0.22.0, not 0.18.0.
- SGLang's LlamaForCausalLM.set_embed (the EAGLE-3 draft inherits it, 0.5.6 to 0.5.23) returns early when the
  draft config's target_hidden_size is not its hidden_size: such a draft runs on its own embed_tokens."""

from __future__ import annotations

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
    m = re.search(r"serve with (sglang|vllm) ([\d.]+) or later", fix)
    if m:
        out.append((raw, f"{m.group(1)}@{m.group(2)}"))
    if 'write "norm_before_fc": true at the top level' in fix:
        v = re.search(r"at the top level too for (?:vllm|sglang) ([\d.]+) or later", fix)
        out.append(({**raw, "norm_before_fc": True}, f"{server.partition('@')[0]}@{v.group(1)}" if v else server))
    return out


RELEASES = ["vllm@0.11.0", "vllm@0.17.1", "vllm@0.18.0", "vllm@0.21.0", "vllm@0.22.0", "vllm@0.34.0",
            "sglang@0.5.6", "sglang@0.5.16", "sglang@0.5.17", "sglang@0.5.23"]


@settings(max_examples=30, deadline=None)
@given(top=st.sampled_from([None, True, False]), nested=st.sampled_from([None, True, False]),
       server=st.sampled_from(RELEASES))
@example(top=None, nested=True, server="vllm@0.17.1")  # the audit's case: the fix named 0.18.0
def test_every_norm_fix_applied_as_printed_clears_it_in_the_release_it_names(top, nested, server):
    raw = {**CONFIG, **({} if top is None else {"norm_before_fc": top}),
           **({} if nested is None else {"eagle_config": {"norm_before_fc": nested}})}
    for f in norms(raw, server):
        ways = user_applies(raw, f.fix, server)
        assert ways, f.fix
        for changed, release in ways:
            assert norms(changed, release) == [], (f.fix, release, changed)


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
