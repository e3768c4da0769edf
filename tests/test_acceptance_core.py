"""The offline acceptance measurement (tpsim.draft.acceptance): every row's chain computed in one pass equals
the chain the engine computes at that round with only the prefix it has (no row sees a later token or
capture); the round walk's accounting (tokens emitted = AL x rounds, per-position shares non-increasing);
a draft that always proposes the target's tokens accepts k per round, one that never does accepts none."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings, strategies as st

from tpsim.draft.acceptance import Acceptance, chains, greedy_prefix, paired, rounds
from tpsim.draft.config import DraftConfig
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.weights import specs
from tpsim.parallel.group import TPGroup


def seeded_draft(seed: int, h: int = 16, vocab: int = 40, vd: int = 24, device: str = "cpu") -> Eagle3Draft:
    cfg = DraftConfig(hidden_size=h, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                      vocab_size=vocab, draft_vocab_size=vd, target_hidden_size=h)
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(cfg, TPGroup(device=torch.device(device)))
    for spec in specs(model).values():
        spec.load(torch.randn(spec.shape, generator=g) / spec.shape[-1] ** 0.5 if len(spec.shape) > 1
                  else 1 + 0.2 * torch.randn(spec.shape, generator=g))
    used = torch.randperm(vocab, generator=g)[:vd].sort().values
    model.d2t.copy_(used - torch.arange(vd))
    return model


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(3, 14), k=st.integers(1, 4), data=st.data())
@example(seed=0, length=3, k=4, data=None)
def test_each_rows_chain_is_the_chain_of_its_prefix_alone(seed, length, k, data):
    draft = seeded_draft(seed)
    g = torch.Generator().manual_seed(seed + 1)
    capture = torch.randn(length, 3 * 16, generator=g)
    tokens = torch.randint(0, 40, (length,), generator=g)
    whole = chains(draft, capture, tokens, k)
    assert whole.shape == (length - 1, k)
    rows = range(length - 1) if data is None else \
        [data.draw(st.integers(0, length - 2), label="row")]
    for r in rows:  # the engine at the round whose last accepted token is r+1: tokens 0..r+1, captures 0..r
        alone = chains(draft, capture[:r + 2], tokens[:r + 2], k)
        assert torch.equal(alone[r], whole[r]), (r, alone[r], whole[r])


def walked(tokens: list[int], k: int, start: int, rnd) -> tuple[Acceptance, int]:
    """Rounds over chains that propose each row's true next tokens or a token never in the text, at random."""
    start = min(start, len(tokens) - 1)
    table = torch.tensor([[rnd.choice([tokens[min(r + 2 + i, len(tokens) - 1)], 99]) for i in range(k)]
                          for r in range(len(tokens) - 1)])
    return rounds(table, tokens, start), start


@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 5), st.integers(1, 10), st.randoms())
def test_round_accounting(tokens, k, start, rnd):
    a, start = walked(tokens, k, start, rnd)
    assert all(0 <= x <= k for x in a.accepted)
    emitted = sum(x + 1 for x in a.accepted)
    assert start + emitted <= len(tokens) - 1 + k + 1
    if a.rounds:
        assert 1 <= a.length <= k + 1 and abs(a.length * a.rounds - emitted) < 1e-9
        per = a.per_position
        assert all(x >= y for x, y in zip(per, per[1:]))
        assert abs(sum(per) - (a.length - 1)) < 1e-9  # AL = 1 + the expected number accepted
    else:
        assert start + k > len(tokens) - 1


@given(st.lists(st.integers(0, 9), min_size=8, max_size=60), st.integers(1, 4), st.integers(1, 6))
def test_a_perfect_draft_accepts_k_and_a_hopeless_one_none(tokens, k, start):
    start = min(start, len(tokens) - 2)
    pad = tokens + [0] * (k + 2)
    perfect = torch.tensor([pad[r + 2:r + 2 + k] for r in range(len(tokens) - 1)])
    a = rounds(perfect, tokens, start)
    assert set(a.accepted) <= {k}
    hopeless = rounds(perfect + 100, tokens, start)
    assert set(hopeless.accepted) <= {0}
    assert hopeless.rounds == max(0, len(tokens) - 1 - k - start + 1)


def test_acceptance_adds_over_sequences_and_knows_its_noise():
    a, b = Acceptance(3, (0, 3, 1)), Acceptance(3, (2,))
    both = a + b
    assert both.accepted == (0, 3, 1, 2) and both.length == 2.5 and both.per_position == [0.75, 0.5, 0.25]
    assert abs(both.stderr - (sum((x + 1 - 2.5) ** 2 for x in both.accepted) / 3 / 4) ** 0.5) < 1e-12
    assert Acceptance(3, (1, 1, 1)).stderr == 0


@given(st.lists(st.integers(0, 3), min_size=2, max_size=30), st.integers(1, 5), st.data())
def test_greedy_prefix_stops_at_the_first_answer_token_the_target_would_not_pick(tokens, start, data):
    start = min(start, len(tokens) - 1)
    argmax = [tokens[t + 1] if t + 1 < len(tokens) else 0 for t in range(len(tokens))]
    assert greedy_prefix(tokens, argmax, start) == len(tokens)
    flip = data.draw(st.integers(start, len(tokens) - 1))
    argmax[flip - 1] = tokens[flip] + 1
    assert greedy_prefix(tokens, argmax, start) == flip


@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=5), st.randoms())
def test_the_paired_difference(rows, rnd):
    a = Acceptance(3, (), tuple(tuple(r) for r in rows))
    assert paired(a, a) == (0.0, 0.0) or not any(rows)
    lower = Acceptance(3, (), tuple(tuple(max(0, x - rnd.randint(0, 1)) for x in r) for r in rows))
    d, se = paired(a, lower)
    back = paired(lower, a)
    if any(rows):
        assert d <= 0 and abs(d + back[0]) < 1e-12 and abs(se - back[1]) < 1e-12 and se >= 0


@given(st.lists(st.integers(0, 5), min_size=2, max_size=60), st.integers(1, 4), st.integers(1, 10), st.randoms())
def test_rounds_are_a_walk_over_every_positions_acceptance(tokens, k, start, rnd):
    a, start = walked(tokens, k, start, rnd)
    (every,) = a.rows
    assert len(every) == max(0, len(tokens) - k - start)
    p = start
    for x in a.accepted:
        assert every[p - start] == x
        p += x + 1


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(3, 14), k=st.integers(1, 4), data=st.data())
def test_a_stale_draft_kv_changes_only_the_rows_that_attend_to_it(seed, length, k, data):
    """A radix-cache hit's stale KV at row r (step 0 run with another request's token for r+1): the chains of
    rows before r are the same; the same token as the sequence's is no change at all; the stale row's own chain is
    the chain of the sequence with that token in its place."""
    draft = seeded_draft(seed)
    g = torch.Generator().manual_seed(seed + 1)
    capture = torch.randn(length, 3 * 16, generator=g)
    tokens = torch.randint(0, 40, (length,), generator=g)
    r = data.draw(st.integers(0, length - 2), label="row")
    x = data.draw(st.integers(0, 39), label="token")
    whole, stale = chains(draft, capture, tokens, k), chains(draft, capture, tokens, k, (r, x))
    assert torch.equal(stale[:r], whole[:r])
    assert torch.equal(chains(draft, capture, tokens, k, (r, int(tokens[r + 1]))), whole)
    swapped = tokens.clone()
    swapped[r + 1] = x
    assert torch.equal(stale[r], chains(draft, capture, swapped, k)[r])
