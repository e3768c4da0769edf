"""The draft forward's own contracts, without the reference package: token pairing, fc skipped after step 0,
a row's chain independent of the rows after it, d2t mapping."""

from __future__ import annotations

import torch

from tpsim.draft.attention import DraftCache
from tpsim.draft.config import DraftConfig
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.pairing import pair
from tpsim.draft.weights import specs

CFG = DraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                  vocab_size=40, draft_vocab_size=12, target_hidden_size=16)


def seeded(seed: int = 0) -> Eagle3Draft:
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(CFG)
    for spec in specs(model).values():
        spec.load(torch.randn(spec.shape, generator=g) / 4)
    model.d2t.copy_(torch.randperm(40, generator=g)[:12].sort().values - torch.arange(12))
    return model


def test_pairing_shifts_by_one_and_appends_the_sampled_token():
    # vLLM's example: [a1, b1, b2, c1, c2, c3] -> [b1, b2, c1, c2, c3, <sampled>]
    assert pair(torch.tensor([1, 2, 3, 4, 5, 6]), 9).tolist() == [2, 3, 4, 5, 6, 9]


def test_rows_are_independent_chains():
    """Row i's two steps do not depend on rows after i: each row is the engines' chain for its prefix."""
    model = seeded()
    g = torch.Generator().manual_seed(1)
    cap, toks, nxt = torch.randn(6, 48, generator=g), torch.randint(0, 40, (6,), generator=g), torch.randint(0, 40, (6,), generator=g)
    with torch.no_grad():
        full = DraftCache()
        s0 = model.first(cap, toks, torch.arange(6), full)
        s1 = model.next(s0, nxt, full)
        part = DraftCache()
        p0 = model.first(cap[:4], toks[:4], torch.arange(4), part)
        p1 = model.next(p0, nxt[:4], part)
    torch.testing.assert_close(s1.logits[:4], p1.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(s0.hidden[:4], p0.hidden, rtol=0, atol=1e-6)
    assert torch.equal(s1.positions, torch.arange(6) + 1)


def test_later_steps_take_the_pre_norm_hidden_not_fc():
    model = seeded()
    with torch.no_grad():
        cache = DraftCache()
        s0 = model.first(torch.randn(3, 48), torch.tensor([1, 2, 3]), torch.arange(3), cache)
        model.fc.weight.zero_()  # fc must not be on the fed-back path
        s1 = model.next(s0, torch.tensor([4, 5, 6]), cache)
    assert s1.hidden.abs().sum() > 0 and s1.hidden.shape == (3, 16)


def test_d2t_maps_draft_ids_to_target_ids():
    model = seeded()
    logits = torch.randn(2, 12)
    full = model.target_logits(logits)
    assert full.shape == (2, 40) and torch.isinf(full).sum() == 2 * (40 - 12)
    assert torch.equal(full.argmax(-1), model.to_target(logits.argmax(-1)))


def test_fc_takes_the_target_width_when_it_differs():
    cfg = DraftConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=4, vocab_size=40, draft_vocab_size=12, target_hidden_size=24)
    model = Eagle3Draft(cfg)
    assert tuple(model.fc.weight.shape) == (16, 72)
    for spec in specs(model).values():
        spec.load(torch.randn(spec.shape) / 4)
    with torch.no_grad():
        cache = DraftCache()
        s0 = model.first(torch.randn(3, 72), torch.tensor([1, 2, 3]), torch.arange(3), cache)
        s1 = model.next(s0, torch.tensor([4, 5, 6]), cache)
    assert s0.hidden.shape == s1.hidden.shape == (3, 16)
