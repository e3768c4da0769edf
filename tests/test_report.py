"""check's verdict (tpsim.run.report) over drawn rank results: the relative errors against TP=1
decide PASS/FAIL by the stated tolerance even when the ranks are identical and finite.

Guards against the mutation that removed the `rel <= tol` failure and still printed PASS with a
planted bug at relative error 4.16e-01 (the suite had no test that failed on it)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from tpsim.capture import resolve
from tpsim.config import load_config
from tpsim.modes import Mode, expected_collectives
from tpsim.run.report import summarize
from tpsim.run.results import RankCheck
from tpsim.run.spec import TOLERANCE, ModelSource, RunSpec, model_path

CFG = load_config(model_path("tiny"))


def rank_results(tp: int, T: int, width: int, rel: float, logits_rel: float) -> list[RankCheck]:
    """Every rank of a TP=tp group: identical, finite, the mode's own collectives, the given errors."""
    ops = [(op, f"model.{op}.{i}", 8) for op, n in expected_collectives(Mode(), CFG, tp).items() for i in range(n)]
    return [RankCheck(tp=tp, rank=r, group_rank=r, group=list(range(tp)), shape=[T, width], identical=True,
                      verdicts=None, finite=True, first_nonfinite=None, rel_err=rel, compared=1.0,
                      logits_rel_err=logits_rel, routing_flip=None,
                      all_reduces=sum(o == "all_reduce" for o, _, _ in ops), all_reduce_bytes=0, collectives=ops)
            for r in range(tp)]


@example(dtype="float32", rel=4.16e-1, logits_rel=0.0)
@example(dtype="float32", rel=TOLERANCE["float32"], logits_rel=0.0)
@example(dtype="bfloat16", rel=0.0, logits_rel=TOLERANCE["bfloat16"] * 1.001)
@given(dtype=st.sampled_from(sorted(TOLERANCE)), rel=st.floats(0, 1), logits_rel=st.floats(0, 1))
def test_relative_error_decides_the_verdict(dtype, rel, logits_rel):
    res = resolve("sglang", None, CFG.num_hidden_layers)
    T, width = 16, len(res.positions) * CFG.hidden_size
    spec = RunSpec(ModelSource("tiny", CFG), 0, dtype, tuple(range(T)), tuple(res.positions))
    report = summarize(spec, res, [2], rank_results(2, T, width, rel, logits_rel))
    tol = TOLERANCE[dtype]
    assert report.ok == (rel <= tol and logits_rel <= tol), report.rows[0].failures
    assert any("relative error" in f and "logits" not in f for f in report.rows[0].failures) == (rel > tol)
    assert any(f.startswith("logits relative error") for f in report.rows[0].failures) == (logits_rel > tol)
