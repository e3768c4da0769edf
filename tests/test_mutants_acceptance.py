"""Issue 55's mutation round on the acceptance verdict: bugs planted in tpsim/draft/acceptance.py and
tpsim/app/acceptance.py that the suite's fast tests let through. Each test names its planted bug and fails with it
in place (checked by planting it)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.app.acceptance import AcceptanceReport, Measured
from tpsim.draft.acceptance import Acceptance, paired

rows = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=2, max_size=5)


@st.composite
def paired_rows(draw) -> tuple[list[list[int]], list[list[int]]]:
    """Per sequence, each position's accepted tokens as trained and as served (the same positions)."""
    a = draw(rows)
    return a, [draw(st.lists(st.integers(0, 3), min_size=len(r), max_size=len(r))) for r in a]


def _acceptance(per_sequence: list[list[int]]) -> Acceptance:
    return Acceptance(3, tuple(a for r in per_sequence for a in r), tuple(tuple(r) for r in per_sequence))


@settings(max_examples=50, deadline=None)
@given(paired_rows())
def test_the_paired_standard_error_shrinks_by_root_two_when_every_sequence_is_seen_twice(pair):
    """Planted bug: the paired difference's standard error returned as a variance. With the sequences as clusters,
    seeing every sequence twice halves the variance of the mean: the standard error shrinks by exactly sqrt(2),
    the mean stays."""
    a_rows, b_rows = pair
    mean, se = paired(_acceptance(a_rows), _acceptance(b_rows))
    mean2, se2 = paired(_acceptance(a_rows * 2), _acceptance(b_rows * 2))
    assert abs(mean2 - mean) < 1e-12 and se >= 0
    assert abs(se2 * 2 ** 0.5 - se) < 1e-12


def _report(a_rows, b_rows) -> AcceptanceReport:
    trained, served = (Measured(None, _acceptance(r)) for r in (a_rows, b_rows))
    return AcceptanceReport(None, None, 3, [], trained, served)


@settings(max_examples=50, deadline=None)
@given(paired_rows())
@example(([[1, 0, 2], [0, 3, 3], [3, 3, 1]], [[0, 3, 0], [3, 3, 0], [3, 2, 1]]))  # 1.22 standard errors below
def test_the_verdict_keeps_unless_two_standard_errors_below(pair):
    """Planted bug: the verdict's bound at one standard error instead of two (a served capture between one and two
    standard errors below the trained one judged a loss). The docs and the printed verdict say two."""
    mean, se = paired(*(_acceptance(r) for r in pair))
    assert _report(*pair).kept is (not mean < -2 * se)
