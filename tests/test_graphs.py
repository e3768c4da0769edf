"""CUDA graphs freeze the capture set (SGLang PR #22836). On real gloo ranks, for drawn configs x tp
x start-up orders x configured positions x batch sizes: a graphed batch captures what was set when
the graphs were captured (the configured positions, the engine's defaults, or nothing), an eager
batch what is set now (always the configured ones), and when the graphed positions are the
configured ones the capture equals TP=1 and is identical on every rank. `check --cuda-graph`
names each broken order and passes the fixed one; the profiles decide the order with --server."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import run_cli
from strategies import forward_cases
from test_properties import TINY
from tpsim.app.report import Fails, graph_findings
from tpsim.capture import Position, PositionKind
from tpsim.config.loader import config_from_dict
from tpsim.profiles.profile import GraphIds
from tpsim.profiles.registry import lookup
from tpsim.profiles.replay import replay
from tpsim.run.graph_jobs import graph_job
from tpsim.run.graphs import CudaGraphs
from tpsim.run.spec import ModelSource, RunSpec

TOL = 1e-5


@st.composite
def graph_cases(draw):
    tp, cfg, positions, seed, ids = draw(forward_cases(min_tokens=2))
    n = draw(st.integers(1, len(ids) - 1), label="graph tokens")
    order = draw(st.sampled_from(list(GraphIds)), label="order")
    return tp, cfg, positions, order, n, seed, ids


@settings(max_examples=max(6, settings.default.max_examples // 10))
@example(c=(2, TINY, [Position(PositionKind.OUT, 0), Position(PositionKind.OUT, 2), Position(PositionKind.OUT, 5)], GraphIds.DEFAULT, 4, 0,
            list(range(16))))
@example(c=(2, TINY, [Position(PositionKind.OUT, 1)], GraphIds.NONE, 1, 0, [3, 4]))
# found by Hypothesis: on one layer SGLang's default ids all miss, so the workaround's graphs capture nothing
@example(c=(1, {"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "vocab_size": 2, "intermediate_size": 16, "num_key_value_heads": 1, "head_dim": 4,
                "rope_scaling": None, "tie_word_embeddings": False}, [Position(PositionKind.EMBED)], GraphIds.DEFAULT, 1, 0, [0, 0]))
@given(c=graph_cases())
def test_a_graph_captures_the_set_frozen_at_start_up(rank_pool, c):
    tp, cfg_d, positions, order, n, seed, ids = c
    cfg = config_from_dict(cfg_d)
    default = tuple(replay(lookup("sglang", cfg.model_type), None, cfg.num_hidden_layers).positions)
    spec = RunSpec(ModelSource("drawn", cfg), seed, "float32", tuple(ids), tuple(positions),
                   graphs=CudaGraphs(order, n, default, "test"))
    out = rank_pool.run(graph_job, spec=spec, tps=[tp])
    checks = {c.tp: c for per_rank in out.values() for c in per_rank}
    assert sorted(checks) == sorted({1, tp})
    configured = [str(p) for p in positions]
    frozen = {GraphIds.CONFIG: configured, GraphIds.DEFAULT: [str(p) for p in default], GraphIds.NONE: []}[order]
    for c in checks.values():
        assert (c.graphed_tokens, c.eager_tokens) == (n, len(ids))
        assert c.graphed == frozen and c.eager == configured
        assert c.identical
        if c.graphed == configured:
            assert c.rel_err is not None and c.rel_err <= TOL
        broken = graph_findings(c, order, TOL)
        assert bool(broken) == (c.graphed != configured)
        if broken and order is GraphIds.NONE:
            assert broken[0].kind is Fails.GRAPHS_CAPTURE_NOTHING
            assert "captured nothing" in broken[0].text and "before the capture set was set" in broken[0].text
        elif broken:
            assert broken[0].kind is Fails.GRAPHS_CAPTURE_DEFAULTS
            assert "the default ids' positions" in broken[0].text and "mixed within one server" in broken[0].text


def test_check_cuda_graph_follows_the_profile_and_names_the_order():
    argv = ["check", "--cuda-graph", "--tp", "1,2", "--layers", "0,2,5", "--seq-len", "8"]
    before = run_cli(*argv, "--server", "sglang@0.5.10")
    assert before.returncode == 1, before
    assert ("FAIL TP=2: CUDA graph: the graphed batch of 4 tokens captured out(1), out(3), out(4), the default ids' "
            "positions, where the eager batch of 8 tokens captures out(0), out(2), out(5)") in before.stdout
    fixed = run_cli(*argv, "--server", "sglang@0.5.11")
    assert fixed.returncode == 0, fixed
    assert "PASS: CUDA-graphed batches capture the configured positions at TP 1, 2" in fixed.stdout
    none = run_cli(*argv, "--graph-ids", "none")
    assert none.returncode == 1 and "captured nothing (0 of 3 slots)" in none.stdout, none
