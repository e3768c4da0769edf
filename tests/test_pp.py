"""Pipeline parallelism (`--pp`) on real gloo ranks: for drawn configs x pp x tp (pp dividing L or
not) x token counts, the stages compute the TP=1, PP=1 model (what reaches the draft and the
logits), every stage runs exactly its formula's collectives (send/recv counted), the handoff
capture passes, and the early-return capture is caught naming pipeline parallel and the stage of
every lost slot. Plus the layer split of each engine, and the CLI."""

from __future__ import annotations

import os

from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import assert_one_line_error, cli_env, run_cli, run_clis
from strategies import boundary_positions, config_dicts, token_ids
from test_properties import TINY
from tpsim.capture import Position, PositionKind
from tpsim.capture.pipeline import PP_CAPTURES, Handoff, stage_of
from tpsim.config.loader import config_from_dict
from tpsim.parallel.pipeline import Split, stages
from tpsim.run.pipeline import Pipeline, stage_collectives
from tpsim.run.pp_jobs import pp_check_job
from tpsim.app.report import model_collectives, pp_row
from tpsim.run.spec import ModelSource, RunSpec

WORLD = 8  # the rank pool's (conftest)


# --- the layer split ----------------------------------------------------------------------------

def test_split_follows_each_engines_remainder_rule():
    # SGLang: the last L % pp stages one layer more; vLLM: the stages before the last, from the second-to-last back
    assert Split.SGLANG.counts(8, 3) == [2, 3, 3]
    assert Split.VLLM.counts(8, 3) == [3, 3, 2]
    assert Split.SGLANG.counts(10, 4) == [2, 2, 3, 3]
    assert Split.VLLM.counts(10, 4) == [2, 3, 3, 2]
    assert Split.VLLM.counts(9, 2) == [5, 4] and Split.SGLANG.counts(9, 2) == [4, 5]
    assert Split.VLLM.counts(61, 4) == [15, 15, 16, 15]  # DeepSeek-V3 at pp 4: partitions[-2] += 1


@given(L=st.integers(1, 80), pp=st.integers(1, 16), split=st.sampled_from(list(Split)))
def test_split_is_contiguous_and_balanced(L, pp, split):
    if pp > L:
        return
    every = stages(L, pp, 1, split)
    assert [s.start for s in every] == [0] + [s.end for s in every[:-1]] and every[-1].end == L
    counts = [s.end - s.start for s in every]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1
    if L % pp:  # which stage keeps the base count
        assert counts[0 if split is Split.SGLANG else -1] == L // pp


# --- the model on real ranks --------------------------------------------------------------------

@st.composite
def pp_cases(draw):
    tp = draw(st.sampled_from([1, 2, 4]), label="tp")
    pp = draw(st.sampled_from([p for p in (2, 3, 4) if p * tp <= WORLD]), label="pp")
    # dense at tp > 1: a MoE routing near-tie that TP rounding tips is TP's story (test_modes), not PP's;
    # at tp 1 a stage runs exactly the whole model's kernels, MoE included
    cfg = draw(config_dicts(tp, max_layers=5, moe=None if tp == 1 else False))
    cfg["num_hidden_layers"] = L = max(cfg["num_hidden_layers"], pp)
    if cfg["model_type"] == "gpt_oss":
        cfg["layer_types"] = (cfg["layer_types"] * L)[:L]
    T = draw(st.integers(1, 9), label="T")
    positions = draw(boundary_positions(L), label="positions") + draw(st.sampled_from([[], [Position(PositionKind.FINAL)]]))
    split = draw(st.sampled_from(list(Split)), label="split")
    handoff = draw(st.sampled_from(list(PP_CAPTURES.values())), label="handoff")  # REFUSED runs nothing
    ids = draw(token_ids(cfg["vocab_size"], T), label="input_ids")
    return cfg, tp, pp, split, handoff, positions, draw(st.integers(0, 2**31 - 1), label="seed"), ids


@settings(max_examples=max(8, settings.default.max_examples // 10))
@example(c=(TINY, 2, 2, Split.SGLANG, Handoff.LAST_STAGE_ONLY, [Position(PositionKind.EMBED), Position(PositionKind.OUT, 5),
                                                                Position(PositionKind.FINAL)], 0, list(range(7))))
@example(c=({**TINY, "num_hidden_layers": 5}, 1, 3, Split.VLLM, Handoff.HANDOFF,
            [Position(PositionKind.OUT, 0), Position(PositionKind.OUT, 2), Position(PositionKind.OUT, 4)], 1, [3, 1, 4, 1, 5]))
@given(c=pp_cases())
def test_pp_stages_compute_the_whole_model_and_the_capture_is_judged(rank_pool, c):
    cfg_d, tp, pp, split, handoff, positions, seed, ids = c
    cfg = config_from_dict(cfg_d)
    pipe = Pipeline(pp, split, handoff)
    spec = RunSpec(ModelSource("drawn", cfg), seed, "float32", tuple(ids), tuple(positions), pipeline=pipe)
    out = rank_pool.run(pp_check_job, spec=spec, tps=[tp])
    results = [r for rank in range(pp * tp) for r in out[rank]]
    every = pipe.stages(cfg.num_hidden_layers, tp)
    assert sorted(r.rank for r in results) == list(range(pp * tp))
    for r in results:  # each rank's trace is its stage's formula, send/recv counted
        assert r.stage == r.rank // tp
        assert model_collectives(r.collectives) == stage_collectives(cfg, tp, every[r.stage], every, positions,
                                                                    handoff), (r.stage, r.collectives)
    last = [r for r in results if r.stage == pp - 1]
    lost = [p for p in positions if stage_of(p, every) != every[-1]] if handoff is Handoff.LAST_STAGE_ONLY else []
    for r in last:  # what reached the draft, and the logits, equal TP=1, PP=1
        assert r.slots == [str(p) for p in positions if p not in lost]
        assert r.logits_rel_err <= 1e-5 and (r.rel_err is None or r.rel_err <= 1e-5), (r.rel_err, r.logits_rel_err)
        assert r.identical is not False
        if tp == 1:  # the same kernels on the same shapes: bitwise
            assert r.logits_rel_err == 0.0 and r.rel_err in (None, 0.0)
    row = pp_row(spec, tp, results)
    if not lost:
        assert row.ok, row.failures
    else:
        assert not row.ok
        for p in lost:
            s = stage_of(p, every)
            assert any(f.startswith(f"pipeline parallel: {p} is captured on stage {s.index} ") and "returns early" in f
                       for f in row.failures), row.failures
        assert all(f.startswith("pipeline parallel: ") for f in row.failures), row.failures


def test_a_wrong_formula_is_caught():
    """The report compares each stage's trace with its formula: a trace missing the residual send fails."""
    from tpsim.run.results import RankCheck
    cfg = config_from_dict(TINY)
    pipe = Pipeline(2)
    every = pipe.stages(cfg.num_hidden_layers, 1)
    spec = RunSpec(ModelSource("tiny", cfg), 0, "float32", (1, 2), (Position(PositionKind.FINAL),), pipeline=pipe)
    common = dict(tp=1, group_rank=0, identical=True, verdicts=None, finite=True, first_nonfinite=None,
                  compared=1.0, routing_flip=None, real_flip=None, all_reduces=0, all_reduce_bytes=0)
    first = RankCheck(rank=0, group=[0], shape=[], rel_err=None, logits_rel_err=None, stage=0,
                      collectives=[("send", "pipeline.hidden_states", 8)], **common)
    last = RankCheck(rank=1, group=[1], shape=[2, cfg.hidden_size], rel_err=0.0, logits_rel_err=0.0, stage=1,
                     slots=["final"], collectives=[("recv", "pipeline.hidden_states", 8),
                                                   ("recv", "pipeline.residual", 8)], **common)
    row = pp_row(spec, 1, [first, last])
    assert not row.ok and any(f.startswith(f"{every[0]}: collectives per forward send 1, expected send 2")
                              for f in row.failures), row.failures


# --- the CLI ------------------------------------------------------------------------------------

def test_check_pp_passes_with_handoff_and_fails_with_the_early_return():
    runs = run_clis({"handoff": ["check", "--pp", "2", "--tp", "1,2", "--seq-len", "5"],
                     "early": ["check", "--pp", "2", "--tp", "1,2", "--seq-len", "5", "--pp-capture", "last-stage"],
                     "sglang": ["check", "--pp", "2", "--tp", "2", "--seq-len", "5", "--server", "sglang"],
                     "vllm": ["check", "--pp", "3", "--tp", "1", "--seq-len", "5", "--server", "vllm:llama", "--model", "tiny-llama",
                              "--layers", "2,4,7"]})
    ok, early, sglang, vllm = runs["handoff"], runs["early"], runs["sglang"], runs["vllm"]
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("PASS: "), ok
    assert "stage 0: send 3 (send 3); stage 1: recv 3 (recv 3)" in ok.stdout, ok
    assert early.returncode == 1, early
    for tp, ranks in ((1, "0..0"), (2, "0..1")):
        assert (f"FAIL TP={tp}: pipeline parallel: out(1) is captured on stage 0 (layers 0..3, ranks {ranks}), which "
                "returns early (not the last PP rank): the slot never reaches the draft") in early.stdout, early
    # no released SGLang launches EAGLE-3 under PP: a FAIL in its start-up check's words, nothing run
    assert sglang.returncode == 1, sglang
    assert ("refuses --pp 2 with an EAGLE-3 draft at start-up, so nothing runs: AssertionError: Pipeline parallelism "
            "currently only supports EAGLE (non-multi-layer) speculative decoding") in sglang.stdout, sglang
    assert "validation_hook.py @v0.5.21, check_pipeline_parallel_compat" in sglang.stdout, sglang
    # vLLM's latest llama profile hands the aux states on (llama.py v0.30.0); its split gives stage 2 two layers
    assert vllm.returncode == 0, vllm
    assert "stage 0 (layers 0..2), stage 1 (layers 3..5), stage 2 (layers 6..7)" in vllm.stdout, vllm


def test_explain_pp_shows_the_stages():
    r = run_cli("explain", "--pp", "2", "--tp", "2", "--layer", "5")
    assert r.returncode == 0, r
    assert "pipeline parallel --pp 2 x --tp 2 = 4 ranks" in r.stdout, r
    assert "layer 5 runs on stage 1 (ranks 2,3)" in r.stdout, r
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert ["0", "0..3", "0,1"] == rows[0][:3] and ["1", "4..7", "2,3"] == rows[1][:3], r


def test_pp_bad_input_is_one_line_exit_2():
    cases = {("--pp", "9", "--tp", "1"): ["--pp 9 is more stages than the model's 8 layers", "--pp 8 or fewer"],
             ("--pp", "0"): ["--pp 0 must be at least 1"],
             ("--pp", "two"): ["--pp 'two' is not an integer"],
             ("--pp", "4", "--tp", "4"): ["--pp 4 x --tp 4 would spawn 16 CPU ranks", "--ignore-limits"],
             ("--pp", "2", "--mode", "sp"): ["--pp 2 runs with --mode tp only, not --mode sp"],
             ("--pp-capture", "last-stage"): ["--pp-capture applies with --pp 2 or more"],
             ("--pp", "2", "--server", "sglang", "--pp-capture", "handoff"): ["--server sglang decides capture"],
             ("--pp", "2", "--pp-split", "megatron"): ["unknown --pp-split 'megatron'", "sglang, vllm"]}
    runs = run_clis({k: ["check", *k] for k in cases}, workers=2)
    for k, words in cases.items():
        assert_one_line_error(runs[k], words)
    env = {**cli_env(), "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    r = run_cli("check", "--pp", "2", "--tp", "1", env=env, cwd=os.getcwd(), timeout_s=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("tpsim: error: under torchrun --pp 2 x --tp 1 = 2 ranks, but the world has 4; "
                                "launch 2 ranks or use --tp 2"), r.stderr
