"""Two-batch overlap (`--tbo`, SGLang `--enable-two-batch-overlap`): from layer first_k_dense_replace on
the batch runs as two micro-batches (SGLang's two-chunk split of one sequence: T // 2 and the rest),
outside the engine's capture loop. On real gloo ranks, for drawn DeepSeek-family MoE configs x tp x
token counts x first_k_dense_replace x captured positions:

- the model is the same: logits, and the fixed capture (each micro-batch captured, rows concatenated
  in token order, sglang PR #32680) at every position, equal TP=1 without TBO (float32, 1e-5), and
  every rank holds the same tensors;
- the collectives of one forward are `expected_collectives` (each split layer all-reduces twice per
  micro-batch);
- the engine's capture misses exactly the positions at boundaries >= first_k_dense_replace, the
  rest equal TP=1, and `check`'s report names two-batch overlap and those positions.
"""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import run_cli
from strategies import boundary_positions, config_dicts, token_ids
from test_properties import TINY
from tpsim.capture import Position, PositionKind
from tpsim.config.loader import config_from_dict
from tpsim.modes import Strategy, TensorParallel, expected_collectives
from tpsim.parallel import TPGroup
from tpsim.run.jobs import build_model, comparable_rows, rel_err, routing_rows, run_captured_parts
from tpsim.app.report import summarize
from tpsim.run.results import RankCheck
from tpsim.run.spec import ModelSource, RunSpec
from tpsim.testing.jobs import tbo_job

TOL = 1e-5


@st.composite
def tbo_cases(draw):
    tp = draw(st.sampled_from([1, 2, 4]), label="tp")
    cfg = draw(config_dicts(tp, max_layers=4, moe=True, families=("deepseek_v2",)))
    L = max(cfg["num_hidden_layers"], 2)
    cfg.update(num_hidden_layers=L, first_k_dense_replace=draw(st.integers(1, L - 1), label="first_k_dense_replace"))
    if config_from_dict(cfg).moe_layer_count() == 0:  # moe_layer_freq 2 may leave the split layers dense
        cfg["moe_layer_freq"] = 1
    T = draw(st.integers(2, 9), label="T")
    positions = draw(boundary_positions(L), label="positions")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    ids = draw(token_ids(cfg["vocab_size"], T), label="input_ids")
    return tp, cfg, positions, seed, ids


def report_failures(cfg, ids, positions, tp: int, missing: list[str], strategy: Strategy, ops: list[str]) -> list[str]:
    """check's failure lines for a TP=tp row whose rank missed `missing` and ran the collectives `ops`
    (the report, fed one rank's results)."""
    spec = RunSpec(ModelSource("drawn", cfg), 0, "float32", tuple(ids), tuple(positions), TensorParallel(tbo=True),
                   strategy)
    width = (len(positions) - len(missing)) * cfg.hidden_size
    row = RankCheck(tp=tp, rank=0, group_rank=0, group=[0], shape=[len(ids), width], identical=True, verdicts=None,
                    finite=True, first_nonfinite=None, rel_err=0.0, compared=1.0, logits_rel_err=0.0,
                    routing_flip=None, real_flip=None, all_reduces=0, all_reduce_bytes=0, missing=missing,
                    collectives=[(op, "model", 0) for op in ops])
    return summarize(spec, None, [tp], [row]).rows[0].failures


@settings(max_examples=max(6, settings.default.max_examples // 10))
@example(c=(2, TINY, [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, 3), Position(PositionKind.OUT, 4)], 0, list(range(8))))
@example(c=(4, {**TINY, "first_k_dense_replace": 3}, [Position(PositionKind.EMBED), Position(PositionKind.OUT, 1), Position(PositionKind.OUT, 2),
                                                       Position(PositionKind.OUT, 7)], 1, list(range(3, 10))))
@example(c=(1, {**TINY, "first_k_dense_replace": 7}, [Position(PositionKind.OUT, 6), Position(PositionKind.OUT, 7)], 2, [5, 9]))
@given(c=tbo_cases())
def test_tbo_computes_tp1_and_the_engine_misses_the_split_layers(rank_pool, c):
    tp, cfg_d, positions, seed, ids = c
    cfg = config_from_dict(cfg_d)
    f, H = cfg.first_k_dense_replace, cfg.hidden_size
    out = rank_pool.run(tbo_job, cfg=cfg_d, seed=seed, input_ids=ids, positions=[str(p) for p in positions], tp=tp)
    ref_model = build_model(cfg, TPGroup(), seed, "float32")
    truth, ref_logits = run_captured_parts(ref_model, ids, positions)
    ref_route = routing_rows(ref_model)
    expected = [str(p) for p in positions if p.boundary >= f]
    for r in range(tp):
        got = out[r]
        # rounding may tip a routing near-tie: the entries (and logits rows) it reaches are left out, as check does
        mask = comparable_rows(positions, H, got["routing"], ref_route, len(ids))
        flipped = [int(((got["routing"][k] != ref_route[k]).any(-1)).nonzero().min()) for k in ref_route
                   if (got["routing"][k] != ref_route[k]).any()]
        rows = min(flipped, default=len(ids))
        for logits in got["logits"]:
            assert rows == 0 or rel_err(logits[:rows], ref_logits[:rows]) <= TOL, "two-batch overlap changed the model"
        assert len(got["fixed"]) == len(positions)
        for i, (p, fixed, ref) in enumerate(zip(positions, got["fixed"], truth)):
            keep = mask[:, i * H:(i + 1) * H]
            assert not keep.any() or rel_err(fixed[keep], ref[keep]) <= TOL, f"the micro-batch capture of {p}"
        assert got["missing"] == expected, "the engine's capture misses other positions than the split layers'"
        captured = [i for i, p in enumerate(positions) if p.boundary < f]
        assert len(got["engine"]) == len(captured)
        for i, engine in zip(captured, got["engine"]):
            keep = mask[:, i * H:(i + 1) * H]
            assert not keep.any() or rel_err(engine[keep], truth[i][keep]) <= TOL, positions[i]
        for key in ("engine", "fixed"):
            assert all(torch.equal(a, b) for a, b in zip(got[key], out[0][key])), f"rank {r}'s {key} capture"
        assert dict(Counter(got["collectives"])) == expected_collectives(TensorParallel(tbo=True), cfg, tp)
    failures = report_failures(cfg, ids, positions, tp, expected, Strategy.MODEL_LEVEL, out[0]["collectives"])
    if expected:
        line = f"two-batch overlap: {', '.join(expected)} {'is' if len(expected) == 1 else 'are'} in the TBO region " \
               f"(layers >= first_k_dense_replace = {f})"
        assert failures[0].startswith(line), failures
        assert f"{len(positions) - len(expected)} of {len(positions)} slots captured" in failures[0]
    else:
        assert not failures, failures
    assert not report_failures(cfg, ids, positions, tp, [], Strategy.MICRO_BATCHES, out[0]["collectives"])


def test_check_tbo_names_the_region_and_the_micro_batch_capture_passes():
    bad = run_cli("check", "--tbo", "--tp", "1,2", "--seq-len", "7", "--override", "first_k_dense_replace=3")
    assert bad.returncode == 1, bad
    assert ("FAIL TP=2: two-batch overlap: out(3), out(4) are in the TBO region (layers >= first_k_dense_replace = 3), "
            "which runs outside the capture loop: 1 of 3 slots captured") in bad.stdout, bad.stdout
    assert "27 (27)" in bad.stdout  # 1 + 2 * 3 + 4 * 5 all-reduces traced, as expected
    good = run_cli("check", "--tbo", "--strategy", "micro-batches", "--tp", "1,2", "--seq-len", "7",
                   "--override", "first_k_dense_replace=3")
    assert good.returncode == 0, good
    assert "PASS" in good.stdout
