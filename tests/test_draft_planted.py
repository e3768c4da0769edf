"""Issue 55 item 10: bugs planted one at a time in draft/ that no test caught. Each test here names its planted bug
and fails with it in place (checked by planting it: docs/testing.md), by a property of the engines' draft, not a
restatement of tpsim's code: the normed state under norm_output, scale invariance under norm_before_fc, each
row's chain as the engines decode it one prefix at a time, the greedy prefix from the first answer token."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.draft.acceptance import chains, greedy_prefix
from tpsim.draft.attention import DraftCache
from tpsim.draft.model import DraftStep, Eagle3Draft
from tpsim.draft.weights import specs
from test_draft_forward import CFG


def drafted(seed: int, **flags) -> Eagle3Draft:
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(dataclasses.replace(CFG, **flags))
    for spec in specs(model).values():
        spec.load(torch.randn(spec.shape, generator=g) / 4 + (1.0 if spec.shape == (spec.shape[0],) else 0.0))
    model.d2t.copy_(torch.randperm(40, generator=g)[:12].sort().values - torch.arange(12))
    return model


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1).sqrt()


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.booleans())
def test_norm_output_feeds_the_next_step_the_normed_hidden(seed, norm_output):
    """Planted bug: `norm_output` ignored in the state the draft feeds back (EAGLE-3.1 drafts fed the pre-norm
    hidden). With the final norm's weight at 1, the state fed back under norm_output has unit RMS per row and the
    logits are its lm_head; without it, the logits are lm_head of the state normed."""
    model = drafted(seed, norm_output=norm_output)
    with torch.no_grad():
        model.norm.weight.fill_(1.0)
        g = torch.Generator().manual_seed(seed)
        step = model.first(torch.randn(5, 48, generator=g), torch.randint(0, 40, (5,), generator=g), torch.arange(5),
                           DraftCache())
        normed = step.hidden / torch.sqrt(step.hidden.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps)
    if norm_output:
        torch.testing.assert_close(_rms(step.hidden), torch.ones(5), atol=1e-3, rtol=0)
        torch.testing.assert_close(step.logits, model.lm_head(step.hidden), atol=1e-5, rtol=0)
    else:
        assert not torch.allclose(_rms(step.hidden), torch.ones(5), atol=1e-2)
        torch.testing.assert_close(step.logits, model.lm_head(normed), atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.5, 100.0))  # well above rms_norm_eps
@example(0, 10.0)
def test_norm_before_fc_makes_step_0_blind_to_the_captures_scale(seed, scale):
    """Planted bug: the draft's `input_norm` dropped (norm_before_fc drafts ran fc on the raw capture). One
    RMSNorm over the whole capture before fc: scaling the capture changes nothing; without the norm it would."""
    model = drafted(seed, norm_before_fc=True)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(seed)) + 0.5
    with torch.no_grad():
        torch.testing.assert_close(model.project(x * scale), model.project(x), atol=1e-4, rtol=1e-3)
        plain = drafted(seed)
        plain.fc.weight.copy_(model.fc.weight)
        assert not torch.allclose(plain.project(x * 3.0), plain.project(x), atol=1e-3)  # the property has teeth


class _OnePrefix(DraftCache):
    """The engines' chain decode for one prefix: step 0's keys for rows 0..t, then one row of keys per step, all
    of them visible to that row."""

    def mask(self, t: int, device: torch.device) -> torch.Tensor:
        if len(self.keys) == 1:
            return super().mask(t, device)
        return torch.ones(t, sum(k.shape[0] for k in self.keys), dtype=torch.bool, device=device)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 7), st.integers(2, 4))
def test_each_rows_chain_is_its_prefix_decoded_alone(seed, rows, k):
    """Planted bug: the later steps' attention mask made causal in every block (row i attending to the later-step
    keys of rows before it). The batched chains equal, row by row, a draft decoded for that prefix alone: step 0
    over rows 0..t, then row t's own steps, as an engine runs one request."""
    model = drafted(seed)
    g = torch.Generator().manual_seed(seed + 1)
    capture, tokens = torch.randn(rows + 1, 48, generator=g), torch.randint(0, 40, (rows + 1,), generator=g)
    batched = chains(model, capture, tokens, k)
    for t in range(rows):
        cache = _OnePrefix()
        with torch.no_grad():
            step = model.first(capture[:t + 1], tokens[1:t + 2], torch.arange(t + 1), cache)
            last = DraftStep(step.hidden[t:], step.logits[t:], step.positions[t:])
            alone = [model.proposals(last)]
            for _ in range(k - 1):
                last = model.next(last, alone[-1], cache)
                alone.append(model.proposals(last))
        assert batched[t].tolist() == torch.cat(alone).tolist(), (t, batched[t], alone)


@given(st.lists(st.integers(0, 5), min_size=2, max_size=12), st.data())
@example([3, 1, 2], None)
def test_the_greedy_prefix_starts_at_the_first_answer_token(tokens, data):
    """Planted bug: the greedy prefix skipping the first answer token (a sequence whose first answer token is not
    the target's greedy one was kept). The prefix ends at the first answer token t with argmax[t-1] != tokens[t]."""
    start = 1 if data is None else data.draw(st.integers(1, len(tokens) - 1))
    argmax = [0] * len(tokens) if data is None else data.draw(st.lists(st.integers(0, 5), min_size=len(tokens),
                                                                      max_size=len(tokens)))
    agree = [argmax[t - 1] == tokens[t] for t in range(start, len(tokens))]
    expect = start + (agree.index(False) if False in agree else len(agree))
    assert greedy_prefix(tokens, argmax, start) == expect
