"""check's verdict (tpsim.app.report) over drawn rank results: the relative errors against TP=1
decide PASS/FAIL by the stated tolerance even when the ranks are identical and finite.

Guards against the mutation that removed the `rel <= tol` failure and still printed PASS with a
planted bug at relative error 4.16e-01 (the suite had no test that failed on it)."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tpsim.capture import Position, PositionKind
from tpsim.profiles.conventions import resolve
from tpsim.config.loader import load_config
from tpsim.modes import TensorParallel, expected_collectives
from tpsim.run.jobs import NEAR_TIE, comparable_rows, judge_flips
from tpsim.app.report import summarize
from tpsim.run.results import RankCheck
from tpsim.run.spec import TOLERANCE, ModelSource, RunSpec, model_path

CFG = load_config(model_path("tiny"))


def rank_results(tp: int, T: int, width: int, rel: float, logits_rel: float) -> list[RankCheck]:
    """Every rank of a TP=tp group: identical, finite, the mode's own collectives, the given errors."""
    ops = [(op, f"model.{op}.{i}", 8) for op, n in expected_collectives(TensorParallel(), CFG, tp).items() for i in range(n)]
    return [RankCheck(tp=tp, rank=r, group_rank=r, group=list(range(tp)), shape=[T, width], identical=True,
                      verdicts=None, finite=True, first_nonfinite=None, rel_err=rel, compared=1.0,
                      logits_rel_err=logits_rel, routing_flip=None, real_flip=None,
                      all_reduces=sum(o == "all_reduce" for o, _, _ in ops), all_reduce_bytes=0, collectives=ops)
            for r in range(tp)]


@example(dtype="float32", rel=4.16e-1, logits_rel=0.0)
@example(dtype="float32", rel=TOLERANCE["float32"], logits_rel=0.0)
@example(dtype="bfloat16", rel=0.0, logits_rel=TOLERANCE["bfloat16"] * 1.001)
@given(dtype=st.sampled_from(sorted(TOLERANCE)), rel=st.floats(0, 1), logits_rel=st.floats(0, 1))
def test_relative_error_decides_the_verdict(dtype, rel, logits_rel):
    res = resolve("sglang-ids", None, CFG.num_hidden_layers)
    T, width = 16, len(res.positions) * CFG.hidden_size
    spec = RunSpec(ModelSource("tiny", CFG), 0, dtype, tuple(range(T)), tuple(res.positions))
    report = summarize(spec, res, [2], rank_results(2, T, width, rel, logits_rel))
    tol = TOLERANCE[dtype]
    assert report.ok == (rel <= tol and logits_rel <= tol), report.rows[0].failures
    assert any("relative error" in f and "logits" not in f for f in report.rows[0].failures) == (rel > tol)
    assert any(f.startswith("logits relative error") for f in report.rows[0].failures) == (logits_rel > tol)


def test_a_flip_across_a_wide_router_margin_fails_check():
    """check excused a real bug as rounding: with the shared experts added on every rank before the
    reduce, every token's routing moved and check compared 42 % of the capture and said "a routing
    near-tie". A flip is excused only when its router margin is measured below NEAR_TIE."""
    res = resolve("sglang-ids", None, CFG.num_hidden_layers)
    T, width = 16, len(res.positions) * CFG.hidden_size
    spec = RunSpec(ModelSource("tiny", CFG), 0, "float32", tuple(range(T)), tuple(res.positions))
    rows = [replace(r, real_flip=(1, 0, 0.03)) for r in rank_results(2, T, width, 0.0, 0.0)]
    report = summarize(spec, res, [2], rows)
    assert not report.ok
    assert any("token 0 picked other experts than at TP=1 in MoE layer 1 across a router margin of 3.00e-02" in f
               and "not rounding" in f for f in report.rows[0].failures), report.rows[0].failures


def _routing(flips: dict[int, list[int]], T: int = 8, E: int = 4) -> tuple[dict, dict]:
    a = {k: torch.zeros(T, 2, dtype=torch.long) for k in range(1, 4)}
    b = {k: v.clone() for k, v in a.items()}
    for k, tokens in flips.items():
        b[k][tokens, 1] = E - 1
    return a, b


@example(margin=NEAR_TIE["float32"] * 0.999, later=True)
@example(margin=NEAR_TIE["float32"], later=False)
@given(margin=st.floats(0, 1), later=st.booleans())
def test_judge_flips_excuses_near_ties_and_what_they_carry(margin, later):
    """A flip at (layer 1, token 3) with the drawn margin; a consequence at (layer 2, token 5), with a
    wide margin, that causal attention carries from it only when the first is excused; a flip at
    (layer 3, token 1), earlier than token 3, that nothing explains."""
    flips = {1: [3], 2: [5] if later else [], 3: [1]}
    a, b = _routing(flips)
    wide = {k: torch.full((8,), 0.5) for k in a}
    tight = {k: v.clone() for k, v in wide.items()}
    tight[1][3] = margin
    excused, real = judge_flips(a, b, tight, wide, NEAR_TIE["float32"])
    near = float(tight[1][3]) < NEAR_TIE["float32"]  # as stored (float32)
    assert [(f.layer, f.token) for f in excused] == ([(1, 3)] if near else [])
    want_real = ([] if near else [(1, 3)]) + ([(2, 5)] if later and not near else []) + [(3, 1)]
    assert [(f.layer, f.token) for f in real] == want_real
    mask = comparable_rows([Position(PositionKind.OUT, 0), Position(PositionKind.OUT, 2)], 4, a, b, 8, excused)
    assert bool(mask[:, 4:].all()) == (not near)  # out(2) is after layer 1: tokens >= 3 left out when excused
    assert bool(mask[:, :4].all())  # out(0) is before every flip


def test_a_row_the_moe_never_saw_is_no_flip():
    """dp-attention's --dp-local-tokens per-request leaves rows out of the MoE (ids -1): their
    difference shows in the capture, not as a routing flip; a routed row that differs still is one."""
    ref = {1: torch.tensor([[0, 1], [2, 3], [0, 2]])}
    got = {1: torch.tensor([[0, 1], [-1, -1], [1, 2]])}
    margins = {1: torch.tensor([1.0, 1.0, 1.0])}
    excused, real = judge_flips(got, ref, margins, margins, NEAR_TIE["float32"])
    assert excused == [] and [(f.layer, f.token) for f in real] == [(1, 2)]
