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
