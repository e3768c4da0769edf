"""Tests that kill the survivors of a mutation run (issue 38): each pins a behaviour that a planted
bug changed while every other test still passed. The planted bug of each is named in its docstring."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.config.loader import load_config
from tpsim.layers.probe import Sink
from tpsim.modes import TensorParallel
from tpsim.parallel import TPGroup
from tpsim.run.jobs import build_model

TINY = load_config("configs/tiny.yaml")


class MicroBatches(Sink):
    def __init__(self):
        self.seen: list[tuple[int, int, int, int]] = []

    def micro_batch(self, b, start, total, hidden, residual):
        self.seen.append((b, start, hidden.shape[0], total))


@settings(max_examples=6, deadline=None)
@given(T=st.integers(2, 23))
@example(T=5)  # odd: ceil(T / 2) for the first micro-batch survived every other test
def test_two_batch_overlap_gives_the_first_micro_batch_the_floor_half(T):
    """Planted: micro-batch A of ceil(T / 2) tokens. SGLang's two-chunk split (compute_split_token_index:
    `sum(extend_seq_lens) // 2`, tpsim.modes.tbo) gives A the floor half and B the rest, at every
    layer of the split region."""
    model = build_model(TINY, TPGroup(device=torch.device("cpu")), 0, "float32", mode=TensorParallel(tbo=True))
    sink = MicroBatches()
    with torch.inference_mode(), model.probe.attach(sink):
        model(torch.arange(T) % TINY.vocab_size)
    layers = range(TINY.first_k_dense_replace, TINY.num_hidden_layers + 1)
    assert sorted(sink.seen) == sorted((b, s, n, T) for b in layers for s, n in ((0, T // 2), (T // 2, T - T // 2)))


def test_a_release_candidate_comes_before_its_release():
    """Planted: rc sorted after its release, so `sglang@0.5.14rc1` took 0.5.14's profile (with its fusion
    change). An unlisted rc replays the release before it."""
    from tpsim.profiles.registry import lookup, version_key
    assert version_key("0.5.14rc1") < version_key("0.5.14") < version_key("0.5.14.post1") < version_key("0.5.15")
    assert lookup("sglang@0.5.14rc1", "deepseek_v3").name == lookup("sglang@0.5.13", "deepseek_v3").name
    assert lookup("sglang@0.5.14", "deepseek_v3").name != lookup("sglang@0.5.13", "deepseek_v3").name


@settings(max_examples=30, deadline=None)
@given(gap=st.integers(1, 400), after=st.booleans())
@example(gap=5, after=True)  # merged between 0.5.14 and 0.5.15: in 0.5.15, not in an unlisted 0.5.14.1
def test_a_change_known_only_by_merge_date_is_in_a_release_only_if_merged_before_it(gap, after):
    """Planted: an unlisted version rounded up to the next release's date, so a change merged after the
    release it follows counted as in it. An unlisted version is the code of the release before it."""
    from datetime import timedelta
    from tpsim.profiles.cited import Change
    from tpsim.profiles.registry import RELEASES, _when
    day = RELEASES["sglang"]["0.5.14"]  # 0.5.14.1 lies between 0.5.14 and 0.5.15 (two weeks later)
    merged = day + timedelta(days=gap) if after else day - timedelta(days=gap)
    change = Change(("#1",), "a change with no release", merged, None, {})
    assert _when("sglang", "0.5.14.1").has(change, RELEASES["sglang"]) is (not after)


def test_an_empty_list_an_engine_treats_as_unset_reads_the_next_key():
    """Planted: an empty id list under Empty.DEFAULT stopped the key search (the default ids) instead of
    reading the next key; vLLM 0.25.0 (runner v1, Llama) reads dflash_config.target_layer_ids (+1) next."""
    from tpsim.profiles.draft import read_ids
    from tpsim.profiles.profile import Empty
    from tpsim.profiles.registry import lookup
    profile = lookup("vllm@0.25.0:llama", "llama")
    assert profile.behaviour.config.value.empty is Empty.DEFAULT
    raw = {"eagle_aux_hidden_state_layer_ids": [], "dflash_config": {"target_layer_ids": [1, 2, 3]}}
    got = read_ids(profile, raw)
    assert got.ids == [2, 3, 4] and "dflash_config" in got.where
