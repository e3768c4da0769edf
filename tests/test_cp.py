"""Context parallelism (`--mode cp`, tpsim.modes.kinds.ContextParallel) on real gloo ranks: for drawn
configs of every family x CP degrees 2, 3, 4 x token counts that the degree does not divide, the
model computes the TP=1 model (final hidden state and logits), runs exactly the formula's
collectives with the formula's bytes (one KV all-gather per layer, one of the final norm's output),
its `gathered` capture equals the TP=1 capture on every rank, and its `local` capture is each
rank's contiguous token chunk, which the diagnosis calls Shard(dim=0) and `check` fails naming
context parallel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import run_cli
from conftest import Pool
from strategies import boundary_positions, config_dicts, token_ids
from test_properties import TINY
from tpsim.capture import Position, PositionKind
from tpsim.offline.diagnosis import diagnose_tensors
from tpsim.config.loader import config_from_dict
from tpsim.model.decoder import split_sizes
from tpsim.modes import ContextParallel, Strategy, expected_collectives
from tpsim.parallel import TPGroup
from tpsim.run.jobs import build_model, rel_err, routing_rows, run_captured_parts
from tpsim.testing.jobs import mode_job

TOL = 1e-5  # float32 ‖Δ‖/‖ref‖
CP = ContextParallel()


@st.composite
def cp_cases(draw):
    cp = draw(st.sampled_from([2, 3, 4]), label="cp")
    cfg = draw(config_dicts(cp, max_layers=2))
    T = draw(st.integers(cp, 11), label="T")
    positions = draw(boundary_positions(cfg["num_hidden_layers"]), label="positions") + [Position(PositionKind.FINAL)]
    return cp, cfg, positions, draw(st.integers(0, 2**31 - 1), label="seed"), draw(token_ids(cfg["vocab_size"], T))


@pytest.fixture(scope="module")
def pool3():
    """A world of 3 ranks: the session's pool of 8 holds groups of the degrees dividing 8 only."""
    pool = Pool(3)
    yield pool
    pool.close()


def op_counts(pairs) -> dict[str, int]:
    total: dict[str, int] = {}
    for op, n in pairs:
        total[op] = total.get(op, 0) + n
    return total


@settings(max_examples=max(6, settings.default.max_examples // 20))
@example(c=(3, TINY, [Position(PositionKind.EMBED), Position(PositionKind.OUT, 3), Position(PositionKind.FINAL)], 0, list(range(7))))
@example(c=(4, {"model_type": "gpt_oss", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                "vocab_size": 37, "intermediate_size": 16, "num_key_value_heads": 2, "head_dim": 4,
                "rope_scaling": None, "attention_bias": True, "tie_word_embeddings": False, "num_local_experts": 2,
                "num_experts_per_tok": 1, "sliding_window": 2, "layer_types": ["sliding_attention", "full_attention"],
                "swiglu_limit": 7.0}, [Position(PositionKind.OUT, 0), Position(PositionKind.FINAL)], 1, [3, 1, 4, 1, 5, 9]))
@given(c=cp_cases())
def test_cp_computes_tp1_runs_its_formula_and_local_capture_is_caught(rank_pool, pool3, c):
    cp, cfg_d, positions, seed, ids = c
    cfg, T, H = config_from_dict(cfg_d), len(ids), cfg_d["hidden_size"]
    out = (pool3 if cp == 3 else rank_pool).run(mode_job, cfg=cfg_d, seed=seed, input_ids=ids, positions=[str(p) for p in positions], tp=cp,
                        mode=CP.to_dict(), strategies=[Strategy.GATHERED, Strategy.LOCAL])
    ranks = [out[r] for r in range(cp)]
    model = build_model(cfg, TPGroup(), seed, "float32")
    ref, ref_logits = run_captured_parts(model, ids, positions)
    ref_route = routing_rows(model)
    sizes = split_sizes(T, cp)

    # the trace is the formula: per layer one all-gather of the KV cache's rows, then the final norm's
    want_callers = [f"model.layers.{k}.self_attn.kv_gather" for k in range(cfg.num_hidden_layers)] + ["model.norm"]
    for r in ranks:
        assert op_counts((op, 1) for op, _ in r["collectives"]) == expected_collectives(CP, cfg, cp)
        assert [c for _, c in r["collectives"]] == want_callers
        assert op_counts(r["collective_bytes"]) == CP.collective_bytes(cfg, cp, sizes, 4)

    # the same model: every rank's gathered capture is TP=1's, and so are the logits (unless rounding
    # flipped a routing near-tie)
    gathered = ranks[0]["captures"][Strategy.GATHERED]
    for r in ranks:
        assert all(torch.equal(a, b) for a, b in zip(r["captures"][Strategy.GATHERED], gathered)), "ranks differ"
    assert all(tuple(t.shape) == (T, H) for t in gathered)
    if all(torch.equal(ranks[0]["routing"][k], ref_route[k]) for k in ref_route):
        assert rel_err(ranks[0]["logits"], ref_logits) <= TOL
        for t, want in zip(gathered, ref):
            assert rel_err(t, want) <= TOL  # `final` among them: the final hidden state

    # the scattered capture: rank r holds its contiguous chunk, and the diagnosis says so
    starts = [sum(sizes[:r]) for r in range(cp)]
    for i, p in enumerate(positions):
        local = [r["captures"][Strategy.LOCAL][i] for r in ranks]
        for r, t in enumerate(local):
            assert torch.equal(t, gathered[i][starts[r]:starts[r] + sizes[r]]), (r, str(p))
        v = diagnose_tensors(local, {str(p): gathered[i]}, str(p))
        assert v.placement == "Shard(dim=0)" and not v.correct, v.reason


@pytest.mark.parametrize("model, tps", [("tiny", "1,3"), ("tiny-qwen3", "1,2")])
def test_check_cp_passes_gathered_and_fails_local_naming_context_parallel(model, tps):
    """`tpsim check --mode cp` end to end (MLA and GQA): the gathered capture passes; the local one exits 1
    with the Shard(dim=0) verdict and the reason naming context parallel and the fix. A CP degree need not
    divide the heads or the vocabulary (tiny has 8 heads): every weight is whole on each rank."""
    ok = run_cli("check", "--mode", "cp", "--tp", tps, "--seq-len", "7", "--model", model)
    assert ok.returncode == 0, ok
    assert ok.stdout.splitlines()[-1].startswith("PASS: "), ok
    assert "mode cp, capture strategy gathered: context parallel" in ok.stdout, ok
    bad = run_cli("check", "--mode", "cp", "--tp", tps, "--seq-len", "7", "--model", model, "--strategy", "local")
    assert bad.returncode == 1, bad
    assert "Shard(dim=0)" in bad.stdout and "context parallel keeps the stream token-sharded" in bad.stdout, bad
    assert "--strategy gathered" in bad.stdout, bad


def test_explain_cp_shows_the_token_shards_and_the_kv_gather():
    r = run_cli("explain", "--mode", "cp", "--tp", "2", "--seq-len", "5")
    assert r.returncode == 0, r
    assert "Shard(dim=0)" in r.stdout, r
    j = run_cli("explain", "--mode", "cp", "--tp", "2", "--seq-len", "5", "--json")  # the table wraps long names
    assert "model.layers.1.self_attn.kv_gather" in j.stdout, j
    assert "context parallel" in r.stdout, r
