"""dp-attention's gather modes and LM head on real gloo ranks (tpsim.modes.kinds.DpAttention, with
the SGLang sources): for drawn configs x TP degrees x token counts (uneven over the ranks) x
`--dp-padding` {sum-len, max-len} x `--enable-dp-lm-head` {off, on}, every rank's capture and
logits equal its own sequence through a TP=1 replica, the trace is the formula of
`DpAttention.collectives` op by op and its bytes those of `DpAttention.collective_bytes`, and
each collective runs where SGLang runs it (the MLP input gathered by all-reduce or all-gather,
the head's gather an all-reduce whatever the MLP's padding). Under `--dp-local-tokens per-request`
(sglang issue #16274) check fails naming the local count wherever a rank runs more than one row."""

from __future__ import annotations


import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from strategies import boundary_positions, config_dicts, token_ids
from test_modes import reference
from test_properties import TINY
from clirun import run_cli
from tpsim.capture import Position, PositionKind
from tpsim.config.loader import config_from_dict
from tpsim.model.decoder import split_sizes
from tpsim.modes import DpAttention, DpLocalTokens, DpPadding, Mode, Strategy, expected_collectives
from tpsim.run.jobs import check_job, rel_err
from tpsim.app.report import model_collectives, summarize
from tpsim.run.spec import ModelSource, RunSpec
from tpsim.testing.jobs import mode_job

TOL = 1e-5  # float32 ‖Δ‖/‖ref‖


@st.composite
def dp_cases(draw):
    tp = draw(st.sampled_from([2, 4, 8]), label="tp")
    cfg = draw(config_dicts(tp, max_layers=2))
    T = draw(st.integers(tp, 13), label="T")
    mode = DpAttention(dp_padding=draw(st.sampled_from(list(DpPadding)), label="dp_padding"),
                dp_lm_head=draw(st.booleans(), label="dp_lm_head"))
    L = cfg["num_hidden_layers"]
    positions = draw(boundary_positions(L), label="positions") + [Position(PositionKind.FINAL)]
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    ids = draw(token_ids(cfg["vocab_size"], T), label="input_ids")
    return mode, tp, cfg, positions, seed, ids


def op_counts(pairs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op, _ in pairs:
        counts[op] = counts.get(op, 0) + 1
    return counts


def op_bytes(pairs) -> dict[str, int]:
    total: dict[str, int] = {}
    for op, n in pairs:
        total[op] = total.get(op, 0) + n
    return total


TIED_GQA = {"model_type": "qwen3", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 70, "intermediate_size": 16, "num_key_value_heads": 2, "head_dim": 8, "rope_scaling": None,
            "attention_bias": False, "tie_word_embeddings": True}


@settings(max_examples=max(5, settings.default.max_examples // 20))
# uneven token counts (5 over 2 ranks) in both padding modes: max-len's buffers are padded, sum-len's are not
@example(c=(DpAttention(DpPadding.MAX_LEN), 2, TINY,
            [Position(PositionKind.EMBED), Position(PositionKind.OUT, 1), Position(PositionKind.FINAL)], 0, list(range(5))))
@example(c=(DpAttention(DpPadding.SUM_LEN), 2, TINY,
            [Position(PositionKind.EMBED), Position(PositionKind.OUT, 1), Position(PositionKind.FINAL)], 0, list(range(5))))
# a tied head, vocab-parallel over 4 ranks, holding its rows of the replicated embedding
@example(c=(DpAttention(), 2, TIED_GQA, [Position(PositionKind.EMBED), Position(PositionKind.FINAL)], 3, [5, 69, 0, 64, 1]))
@example(c=(DpAttention(dp_lm_head=True), 2, TIED_GQA, [Position(PositionKind.FINAL)], 3, [5, 69, 0]))
@given(c=dp_cases())
def test_dp_gather_modes_compute_tp1_and_run_their_formula(rank_pool, c):
    mode, tp, cfg_d, positions, seed, ids = c
    cfg, T, H = config_from_dict(cfg_d), len(ids), cfg_d["hidden_size"]
    out = rank_pool.run(mode_job, cfg=cfg_d, seed=seed, input_ids=ids, positions=[str(p) for p in positions], tp=tp,
                        mode=mode.to_dict(), strategies=[Strategy.LOCAL])
    ranks = [out[r] for r in range(tp)]
    sizes, L = split_sizes(T, tp), cfg.num_hidden_layers
    sum_len = mode.dp_padding is DpPadding.SUM_LEN

    # the trace is the formula: counts and bytes, on every rank
    for r in ranks:
        assert op_counts(r["collectives"]) == expected_collectives(mode, cfg, tp), r["collectives"]
        assert op_bytes(r["collective_bytes"]) == mode.collective_bytes(cfg, tp, sizes, 4), r["collective_bytes"]
    # ... and each collective is where SGLang runs it
    callers = dict((c, op) for op, c in ranks[0]["collectives"])
    assert callers["model.dp_token_counts"] == "all_gather"
    for k in range(L):
        assert callers[f"model.layers.{k}.mlp_gather"] == ("all_reduce" if sum_len else "all_gather")
        assert callers[f"model.layers.{k}.mlp"] == ("all_reduce" if sum_len else "reduce_scatter")
    assert ("lm_head.dp_gather" in callers, "lm_head" in callers) == (not mode.dp_lm_head,) * 2
    if not mode.dp_lm_head:
        assert (callers["lm_head.dp_gather"], callers["lm_head"]) == ("all_reduce", "all_gather")

    # each rank's capture and logits: its own sequence through a TP=1 replica
    ref_parts, ref_logits, ref_route, _ = reference(cfg, seed, ids, positions, mode, tp)
    for r, n in zip(ranks, sizes):
        assert tuple(r["logits"].shape) == (n, cfg.vocab_size)
        assert all(tuple(t.shape) == (n, H) for t in r["captures"][Strategy.LOCAL])
    logits = torch.cat([r["logits"] for r in ranks])
    caps = [torch.cat([r["captures"][Strategy.LOCAL][i] for r in ranks]) for i in range(len(positions))]
    route = ranks[0]["routing"]
    if all(torch.equal(route[k], ref_route[k]) for k in ref_route):  # else a near-tie flipped (test_modes)
        assert rel_err(logits, ref_logits) <= TOL
        for t, ref in zip(caps, ref_parts):
            assert rel_err(t, ref) <= TOL


@pytest.mark.parametrize("argv", [["--dp-padding", "max-len"], ["--enable-dp-lm-head"],
                                  ["--dp-padding", "sum-len", "--enable-dp-lm-head"]])
def test_check_cli_passes_in_each_dp_setting(argv):
    """`tpsim check --mode dp-attention` end to end in the settings the default run does not take
    (check compares the trace with the formula and each rank with its TP=1 replica)."""
    r = run_cli("check", "--tp", "1,2", "--seq-len", "7", "--mode", "dp-attention", *argv, timeout_s=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("PASS: "), r.stdout


def test_mode_round_trips_padding_and_head():
    """The options travel to the ranks as JSON (agree_on_run, check --json) and back."""
    m = DpAttention(dp_padding="max-len", dp_lm_head=True)
    assert m.dp_padding is DpPadding.MAX_LEN and m.to_dict()["dp_padding"] == "max-len"
    assert Mode.from_dict(m.to_dict()) == m
    assert DpAttention().dp_padding is DpPadding.SUM_LEN and not DpAttention().dp_lm_head
    local = DpAttention(dp_local_tokens="per-request")
    assert local.dp_local_tokens is DpLocalTokens.PER_REQUEST and local.to_dict()["dp_local_tokens"] == "per-request"
    assert Mode.from_dict(local.to_dict()) == local and DpAttention().dp_local_tokens is DpLocalTokens.ALL


@st.composite
def local_count_cases(draw):
    tp = draw(st.sampled_from([2, 4, 8]), label="tp")
    cfg = draw(config_dicts(tp, max_layers=2))
    T = draw(st.integers(tp, 13), label="T")
    L = cfg["num_hidden_layers"]
    positions = draw(boundary_positions(L), label="positions")
    ids = draw(token_ids(cfg["vocab_size"], T), label="input_ids")
    return tp, cfg, positions, draw(st.integers(0, 2**31 - 1), label="seed"), ids


@settings(max_examples=max(5, settings.default.max_examples // 20))
@example(c=(2, TINY, [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, 3)], 0, list(range(8))))  # the scenario's 4 rows per rank
@example(c=(4, TINY, [Position(PositionKind.OUT, 1)], 0, [3, 1, 4, 1]))  # one row per rank: the count is right
@example(c=(2, TINY, [Position(PositionKind.EMBED)], 0, [3, 1, 4]))  # rows 2+1; nothing captured after an MLP, the logits tell
@given(c=local_count_cases())
def test_per_request_local_count_fails_check_naming_it(rank_pool, c):
    """sglang issue #16274: each rank places one row per request (tpsim: one) in the MLP's sum-len
    gather and takes one back. Where a rank runs more rows than that, check fails naming the count;
    the trace is still the formula (the buffers keep their sizes: only the values go wrong)."""
    tp, cfg_d, positions, seed, ids = c
    cfg = config_from_dict(cfg_d)
    mode = DpAttention(dp_local_tokens=DpLocalTokens.PER_REQUEST)
    spec = RunSpec(ModelSource("drawn", cfg), seed, "float32", tuple(ids), tuple(positions), mode, Strategy.LOCAL)
    out = rank_pool.run(check_job, spec=spec, tps=[tp])
    results = [r for rank in range(tp) for r in out[rank] if r.tp == tp]
    for r in results:
        assert model_collectives(r.collectives) == expected_collectives(mode, cfg, tp), r.collectives
    if any(r.routing_flip is not None for r in results):  # a near-tie rounding tipped (test_modes)
        return
    sizes = split_sizes(len(ids), tp)
    row = summarize(spec, None, [tp], results).rows[0]
    rows = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
    named = [f for f in row.failures if f.startswith(f"DP attention gathered 1 of {rows} rows per rank ")]
    if max(sizes) > 1:
        assert not row.ok and named and "sglang issue #16274" in named[0], row.failures
    else:
        assert row.ok, row.failures
