"""PD disaggregation's hand-off of the EAGLE-3 draft's state (check --disaggregate) on real gloo ranks:
for drawn prefill/decode TP sizes, prompts, draft widths and SGLang versions, a hand-off whose widths
agree lands bitwise on every decode rank, and one whose widths disagree is the engine's failure (a
finding naming both widths), never a traceback. Plus each version's behaviour and the CLI."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import assert_one_line_error, run_clis
from test_properties import TINY
from tpsim.app.disaggregation import finding
from tpsim.config.loader import config_from_dict
from tpsim.profiles.conventions import Convention, resolve
from tpsim.profiles.pd import PdTransfer, Widths
from tpsim.profiles.pd_versions import PD, pd_version
from tpsim.run.pd_jobs import Disaggregation, pd_job
from tpsim.run.spec import ModelSource, RunSpec

CFG = config_from_dict(TINY)
H = CFG.hidden_size
POSITIONS = tuple(resolve(Convention.SGLANG, None, CFG.num_hidden_layers).positions)


# --- each version's behaviour -----------------------------------------------------------------------

def test_before_9976_the_target_aux_states_go_into_a_target_wide_buffer():
    v = pd_version("sglang@0.5.1")
    assert v.transfer is PdTransfer.TARGET_AUX and v.versions.until.prs == ("#9976",)
    assert "logits_output.hidden_states" in v.cited.source.quote and "shape error" in v.cited.error
    w = Widths(64, 64)
    assert (v.transfer.sent(w), v.transfer.buffer(w)) == (192, 64) and v.failure(w)


def test_between_9976_and_13590_the_draft_state_fits_only_a_draft_as_wide_as_the_target():
    for text in ("sglang@0.5.2", "sglang@0.5.5", "sglang@2025-11-18"):
        v = pd_version(text)
        assert v.transfer is PdTransfer.DRAFT_IN_TARGET_WIDTH, text
        assert v.failure(Widths(64, 64)) is None and "send_kv_chunk" in v.failure(Widths(64, 32))


def test_from_13590_the_buffer_is_the_drafts_width():
    for text in ("sglang@0.5.6", "sglang@2025-11-19", "sglang"):
        v = pd_version(text)
        assert v.transfer is PdTransfer.DRAFT and v.failure(Widths(64, 32)) is None, text
    assert pd_version("sglang@0.5.6").cited.source.symbol == "Scheduler.init_disaggregation"
    assert all(c.release is None for c in PD.changes)  # first releases unknown


def test_the_finding_names_both_widths_the_prs_and_the_fix():
    pd = Disaggregation(1, 1, PdTransfer.TARGET_AUX, Widths(64, 64))
    f = finding(pd, pd_version("sglang@0.5.1"), "torch says so")
    assert "sends 3 x 64 = 192 values per request (the target's aux hidden states) into the decode server's " \
           "64-wide buffer: shape error" in f.cause
    assert "#9976, #13590" in f.fix and "first release unknown" in f.fix


# --- the hand-off on real ranks ----------------------------------------------------------------------

@st.composite
def pd_cases(draw):
    prefill, decode = draw(st.sampled_from([1, 2]), label="P"), draw(st.sampled_from([1, 2]), label="D")
    T = draw(st.integers(1, 9), label="T")
    ids = draw(st.lists(st.integers(0, CFG.vocab_size - 1), min_size=T, max_size=T), label="ids")
    draft = draw(st.sampled_from([H, H // 2, 2 * H, 2]), label="H_draft")
    transfer = draw(st.sampled_from(list(PdTransfer)), label="transfer")
    return prefill, decode, ids, draft, transfer, draw(st.integers(0, 2**31 - 1), label="seed")


@settings(max_examples=max(8, settings.default.max_examples // 10), deadline=None)
@example(c=(1, 2, [1, 2, 3], H, PdTransfer.TARGET_AUX, 0))  # issue #10059: 3 x H into H
@example(c=(2, 1, [5], H // 2, PdTransfer.DRAFT_IN_TARGET_WIDTH, 1))  # PR #13590: a narrower draft
@example(c=(2, 2, [4, 4, 4, 4], H // 2, PdTransfer.DRAFT, 2))
@given(c=pd_cases())
def test_the_handoff_lands_bitwise_or_fails_as_the_engine_does(rank_pool, c):
    prefill, decode, ids, draft, transfer, seed = c
    spec = RunSpec(ModelSource("tiny", CFG), seed, "float32", tuple(ids), POSITIONS)
    w = Widths(H, draft, len(POSITIONS))
    out = rank_pool.run(pd_job, spec=spec, pd=Disaggregation(prefill, decode, transfer, w))
    ranks = {r: x for r, x in out.items() if x is not None}
    assert sorted(ranks) == list(range(prefill + decode))
    sender, decoders = ranks[0], [ranks[r] for r in range(prefill, prefill + decode)]
    if transfer.fits(w):
        assert not sender.failure and sender.sent.shape == (transfer.buffer(w),)
        for d in decoders:
            assert d.received is not None and torch.equal(d.received, sender.sent), d.rank
            assert [op.value for op, _, _ in d.collectives] == ["recv", "recv"]
    else:
        assert sender.sent is None and f"({transfer.buffer(w)})" in sender.failure, sender.failure
        assert all(d.received is None for d in decoders)
    assert [c for _, c, _ in sender.collectives if c.startswith("pd.")] == \
        ["pd.status", *(["pd.hidden_states"] if transfer.fits(w) else [])] * decode


# --- the CLI -------------------------------------------------------------------------------------------

def test_cli_fails_before_the_fixes_and_passes_after_them():
    runs = run_clis({"aux": ["check", "--disaggregate", "1:2", "--server", "sglang@0.5.1", "--seq-len", "4"],
                     "narrow": ["check", "--disaggregate", "2:1", "--server", "sglang@0.5.5", "--draft-hidden", "32",
                                "--seq-len", "4"],
                     "fixed": ["check", "--disaggregate", "2:2", "--server", "sglang@0.5.6", "--draft-hidden", "32",
                               "--seq-len", "4"]})
    aux, narrow, fixed = runs["aux"], runs["narrow"], runs["fixed"]
    assert aux.returncode == 1 and "Traceback" not in aux.stdout + aux.stderr, aux
    assert "sends 3 x 64 = 192 values per request (the target's aux hidden states) into the decode server's " \
           "64-wide buffer: shape error" in aux.stdout and "fix: serve with sglang 0.5.6 or later" in aux.stdout
    assert narrow.returncode == 1 and "sends 32 values per request (the draft's hidden state) into the decode " \
           "server's 64-wide buffer" in narrow.stdout, narrow
    assert fixed.returncode == 0 and fixed.stdout.splitlines()[-1].startswith("PASS: every decode rank's 32-wide"), fixed


def test_cli_bad_input_is_one_line():
    runs = run_clis({
        "sizes": ["check", "--disaggregate", "2", "--server", "sglang"],
        "zero": ["check", "--disaggregate", "0:1", "--server", "sglang"],
        "server": ["check", "--disaggregate", "1:1"],
        "vllm": ["check", "--disaggregate", "1:1", "--server", "vllm"],
        "old": ["check", "--disaggregate", "1:1", "--server", "sglang@0.4.0"],
        "tp": ["check", "--disaggregate", "1:1", "--server", "sglang", "--tp", "2"],
        "odd": ["check", "--disaggregate", "1:1", "--server", "sglang", "--draft-hidden", "33"],
        "alone": ["check", "--draft-hidden", "32"],
    }, workers=4)
    assert_one_line_error(runs["sizes"], ["--disaggregate '2'", "PREFILL_TP:DECODE_TP"])
    assert_one_line_error(runs["zero"], ["two positive integers"])
    assert_one_line_error(runs["server"], ["--server sglang@VERSION"])
    assert_one_line_error(runs["vllm"], ["sglang only"])
    assert_one_line_error(runs["old"], ["from 0.5.1 on"])
    assert_one_line_error(runs["tp"], ["without --tp", "drop --tp"])
    assert_one_line_error(runs["odd"], ["--draft-hidden '33'", "even"])
    assert_one_line_error(runs["alone"], ["--draft-hidden applies with --disaggregate"])
