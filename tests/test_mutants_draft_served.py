"""Issue 55 deliver 5, the mutation round on the served side of a draft: tpsim/app/draft_served.py (what a named
engine version's draft loader does with a checkpoint) and the served half of tpsim/app/acceptance.py (the capture
and the embedding the served draft runs on, the noise and the no-round verdict). Each test names the bug planted
one at a time that the covering tests let through, and fails with it in place (checked by planting it)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from test_draft_checkpoint import CONFIG, clean_tensors
from tpsim.app.acceptance import AcceptanceReport, Measured, _no_round, served_embedding, served_fed
from tpsim.app.draft_engines import releases
from tpsim.app.draft_served import judge, unverified
from tpsim.app.prompts import Sequence
from tpsim.draft.acceptance import Acceptance, has_round
from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.profiles.profile import Served
from tpsim.modes import Strategy, TensorParallel
from tpsim.profiles.loader_lines import LINES, lookup

RELEASES = sorted(f"{e}@{r}" for e in LINES for r in releases(e))
BEFORE = {"sglang": "sglang@0.5.3", "vllm": "vllm@0.10.0"}  # older than the oldest release whose loader was read


def checkpoint(raw: dict, seed: int = 0, extra: dict | None = None) -> DraftCheckpoint:
    cfg = DraftConfig.from_json(raw)
    return DraftCheckpoint(Path("draft"), cfg, {**clean_tensors(cfg, seed), **(extra or {})}, raw=raw)


# --- app/draft_served.py --------------------------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(engine=st.sampled_from(sorted(BEFORE)), name=st.sampled_from(["mtp.0.weight", "lm_head.bias", "extra.weight"]))
@example(engine="vllm", name="lm_head.bias")
def test_a_version_before_the_loaders_read_names_every_tensor_it_may_skip(engine, name):
    """Planted bug: the UNVERIFIED findings for a version older than the oldest loader read left out the tensors
    whose fate that loader was not read for (`reads or skips`). Before the oldest release read, tpsim cannot say
    whether a tensor outside what the read loaders take is read or skipped: each such tensor is one UNVERIFIED
    finding naming it, and no tensor the loaders read is."""
    s = lookup(BEFORE[engine])
    assert s.loader is None
    ckpt = checkpoint(CONFIG, extra={name: torch.zeros(2)})
    keys = {f.key for f in unverified(ckpt, s, None) if f.defect is DraftDefect.UNVERIFIED}
    assert name in keys and not keys & set(s.line.reads.value), keys


@settings(max_examples=40, deadline=None)
@given(server=st.sampled_from(RELEASES), widths_differ=st.booleans(), seed=st.integers(0, 3))
@example(server="sglang@0.5.12", widths_differ=True, seed=0)
@example(server="vllm@0.11.1", widths_differ=False, seed=0)
def test_the_embedding_acceptance_measures_on_is_the_one_tpsim_draft_names(server, widths_differ, seed):
    """Planted bug: acceptance's served embedding read the config's widths backwards (the draft's own embedding
    kept where target_hidden_size equals hidden_size). `tpsim draft --server` says embed-differs exactly when that
    release runs the draft on its own embedding; acceptance measures the served draft on the embedding the same
    release's loader gives it: its own exactly then, else the target's."""
    raw = {**CONFIG, "target_hidden_size": 24 if widths_differ else CONFIG["hidden_size"]}
    ckpt = checkpoint(raw, seed)
    target = torch.randn(CONFIG["vocab_size"], raw["target_hidden_size"], generator=torch.Generator().manual_seed(9))
    s = lookup(server)
    named = any(f.defect is DraftDefect.EMBED_DIFFERS for f in judge(ckpt, s, target))
    embed, why = served_embedding(ckpt, server, target)
    assert (embed is ckpt.tensors["embed_tokens.weight"]) is named, why


# --- app/acceptance.py: the served capture, the noise, the verdict without a round ----------------------------

H = 8


def _served(positions: int, fc_width: int, engine: str = "sglang", embed: int = 100 * H):
    """served_fed's inputs: a replay capturing `positions` states of a hidden size H for a draft whose embedding is
    `embed` wide, served by `engine`, nothing else wrong."""
    replay = SimpleNamespace(positions=[f"out({i})" for i in range(positions)], failure=None,
                             width_text=lambda h: f"{positions} x {h}")
    inputs = SimpleNamespace(target=SimpleNamespace(source=SimpleNamespace(cfg=SimpleNamespace(hidden_size=H))),
                             served=Served(tp=1), serve=SimpleNamespace(name=f"{engine}@0.5.12", engine=engine),
                             draft=SimpleNamespace(raw={"hidden_size": embed}))
    caps = SimpleNamespace(replay=replay, config=SimpleNamespace(off=False, failure=None),
                           mode=SimpleNamespace(mode=TensorParallel(), strategy=Strategy.MODEL_LEVEL))
    return served_fed(inputs, caps, fc_width)


@settings(max_examples=30, deadline=None)
@given(positions=st.integers(1, 6), aux=st.integers(1, 6))
@example(positions=2, aux=3)  # an engine that captures two states for a three-state draft
def test_a_served_capture_of_another_width_than_fc_is_not_measured(positions, aux):
    """Planted bug: served_fed's width check dropped (a served capture of another width than the draft's fc
    measured: the fc fails on it inside the measurement). The served capture is measured only when its width is
    the fc's input width; otherwise its failure names both widths."""
    fed = _served(positions, aux * H)
    assert (fed.failure is None) is (positions == aux), fed
    if fed.failure is not None:
        assert f"{positions} x {H}" in fed.failure and f"takes {aux * H}" in fed.failure


@settings(max_examples=30, deadline=None)
@given(positions=st.integers(1, 6), aux=st.integers(1, 6), engine=st.sampled_from(["sglang", "vllm"]))
@example(positions=1, aux=1, engine="sglang")  # a one-state draft as wide as its target: SGLang skips fc
def test_only_sglang_reads_a_capture_as_wide_as_the_embedding_past_fc(positions, aux, engine):
    """Planted bug: the fc gate taken from the widths alone (as Eagle3Draft.project once did) or for every engine.
    SGLang skips fc for a capture as wide as the draft's embedding, whatever fc takes, and nothing fails; vLLM runs
    fc on it, and its width check stands."""
    fed = _served(positions, aux * H, engine, embed=positions * H)
    assert fed.fc is (engine != "sglang"), fed
    assert (fed.failure is None) is (engine == "sglang" or positions == aux), fed


def _acceptance(accepted: list[int]) -> Acceptance:
    return Acceptance(3, tuple(accepted), (tuple(accepted),))


@settings(max_examples=30, deadline=None)
@given(a=st.lists(st.integers(0, 3), min_size=2, max_size=20), b=st.lists(st.integers(0, 3), min_size=2, max_size=20))
def test_the_noise_is_two_standard_errors_of_the_difference(a, b):
    """Planted bug: AcceptanceReport.noise at one standard error (the JSON's `noise`, documented as two standard
    errors of the AL difference, the two measured apart). Measured apart, the difference's variance is the sum of
    the two: noise^2 = 4 (se_t^2 + se_s^2); a capture against itself, 2 sqrt(2) its standard error."""
    t, s = _acceptance(a), _acceptance(b)
    report = AcceptanceReport(None, None, 3, [], Measured(None, t), Measured(None, s))
    assert abs(report.noise ** 2 - 4 * (t.stderr ** 2 + s.stderr ** 2)) < 1e-9
    same = AcceptanceReport(None, None, 3, [], Measured(None, t), Measured(None, t))
    assert abs(same.noise - 2 * 2 ** 0.5 * t.stderr) < 1e-9


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 50), answers=st.lists(st.integers(1, 60), min_size=1, max_size=4))
@example(k=3, answers=[3])
def test_the_no_round_verdict_names_the_answer_length_a_round_needs(k, answers):
    """Planted bug: the no-round verdict saying k draft tokens need an answer of k tokens (has_round wants k + 1).
    The length it names is the shortest answer that gives a round at k."""
    text = _no_round(k, [Sequence(tuple(range(2 + n)), 2) for n in answers])
    need = int(re.search(r"at least (\d+) tokens", text).group(1))
    assert has_round(need, k) and not has_round(need - 1, k), text
    assert f"the longest kept is {max(answers)}" in text
