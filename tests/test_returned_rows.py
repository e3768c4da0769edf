"""The hidden states SGLang's return_hidden_states gives back under speculative decoding (tpsim/profiles/returned.py:
one row per verify round up to 0.5.13, each round's accepted rows from 0.5.14, PR #28496), and diagnose's reading of
a file with fewer rows than tokens: which tokens' states it holds (placement `token subset`)."""

from __future__ import annotations

import torch
from hypothesis import example, given, strategies as st

from clirun import assert_one_line_error, run_cli
from tpsim.offline.diagnosis import TOKEN_SUBSET, UNEXPLAINED, diagnose_tensors, spans
from tpsim.parallel.placement import R
from tpsim.profiles.returned import RETURNED, Returned


@example(prompt=1, accepted=[0])
@given(prompt=st.integers(1, 40), accepted=st.lists(st.integers(0, 5), max_size=30))
def test_one_row_per_round_is_a_subset_of_the_accepted_rows(prompt, accepted):
    """From 0.5.14 every token the request holds has its row, in order; up to 0.5.13 the prompt's rows and one per
    round (the round's first position), fewer as soon as a round accepts a draft token."""
    every = Returned.ACCEPTED.positions(prompt, tuple(accepted))
    few = Returned.ONE_PER_ROUND.positions(prompt, tuple(accepted))
    assert every == list(range(prompt + sum(a + 1 for a in accepted)))
    assert len(few) == prompt + len(accepted) and set(few) <= set(every) and few == sorted(few)
    assert (len(few) < len(every)) == any(accepted)


def test_the_versions_read():
    assert RETURNED.at("sglang@0.5.13").value is Returned.ONE_PER_ROUND
    assert RETURNED.at("sglang@0.5.14").value is Returned.ACCEPTED and RETURNED.at("sglang").value is Returned.ACCEPTED


@given(T=st.integers(2, 40), keep=st.data(), seed=st.integers(0, 2**16))
def test_diagnose_names_the_tokens_a_short_file_holds(T, keep, seed):
    """A file holding some of a reference's rows, in order, is a token subset naming exactly those tokens; all of
    them is Replicate(); one row changed is unexplained."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(T, 16, generator=g, dtype=torch.float64)
    rows = keep.draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=T, unique=True).map(sorted))
    v = diagnose_tensors([ref[rows].float()], {"out(1)": ref}, "out(1)")
    if len(rows) == T:
        assert v.placement == R and v.correct
        return
    assert v.placement == TOKEN_SUBSET and not v.correct and v.matches == "out(1)"
    assert f"holds {len(rows)} of {T} tokens' states" in v.reason and f"(tokens {spans(tuple(rows))})" in v.reason
    bad = ref[rows].clone()
    bad[len(rows) // 2] = torch.randn(16, generator=g, dtype=torch.float64)
    assert diagnose_tensors([bad.float()], {"out(1)": ref}, "out(1)").placement == UNEXPLAINED


def test_spans():
    assert spans((0, 1, 2, 5, 7, 8)) == "0-2, 5, 7-8" and spans((3,)) == "3"


def test_returned_hidden_states_is_sglangs_and_read_from_0_5_13(tmp_path):
    for server, words in (("vllm@0.34.0", "of sglang only"), ("sglang@0.5.12", "from 0.5.13 on")):
        r = run_cli("acceptance", "--draft", "smollm2-135m-eagle3", "--server", server,
                    "--returned-hidden-states", str(tmp_path / "r.safetensors"))
        assert_one_line_error(r, words)
        assert not list(tmp_path.iterdir())
