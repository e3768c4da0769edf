"""`check --cuda-graph` on every rank: the job that starts the "server" in the order the run's
`CudaGraphs` names (tpsim.run.graphs), runs a graphed and an eager batch, and what is wrong with
the graphed one."""

from __future__ import annotations

import torch

from tpsim.capture.graphs import CaptureSet, GraphRunner, RecordedGraph
from tpsim.modes import Strategy
from tpsim.parallel.launch import RankContext
from tpsim.run.graphs import GraphCheck, start
from tpsim.base.tensors import bitwise_equal
from tpsim.run.jobs import rel_err, run_captured, spec_model
from tpsim.run.spec import RunSpec


def graph_job(ctx: RankContext, spec: RunSpec, tps: list[int]) -> list[GraphCheck]:
    """For each degree in `tps` this rank takes part in: start the server in `spec.graphs.ids`'s order,
    run a graphed batch (the first `tokens` tokens) and an eager one (all of them)."""
    g, config, out = spec.graphs, list(spec.positions), []
    ids = torch.tensor(list(spec.tokens), dtype=torch.long)
    reference = None
    for tp in sorted(set(tps) | {1}):
        if not ctx.participates(tp):
            continue
        group = ctx.groups[tp]
        model = spec_model(spec, group, mode=spec.mode)
        if tp == 1:
            reference, _ = run_captured(model, list(spec.tokens[:g.tokens]), config)
        graph = RecordedGraph
        if group.device.type == "cuda":
            from tpsim.capture.graphs import GraphedForward
            graph = GraphedForward
        runner = GraphRunner(model, CaptureSet(), [g.tokens], spec.strategy if tp > 1 else Strategy.MODEL_LEVEL, graph)
        start(g.ids, runner, config, list(g.default))
        graphed = runner.run(ids[:g.tokens].to(group.device))
        eager = runner.run(ids.to(group.device))
        first = group.broadcast(graphed.capture.contiguous().clone(), "check.graph_identity") if tp > 1 \
            else graphed.capture
        same = torch.tensor([int(bitwise_equal(graphed.capture.contiguous(), first))], device=group.device)
        identical = tp == 1 or int(group.all_reduce(same, "check.graph_identity").item()) == tp
        del model
        if group.rank != 0:
            continue
        err = rel_err(graphed.capture.cpu(), reference.cpu()) \
            if list(graphed.positions) == config and config else None
        out.append(GraphCheck(tp, g.tokens, len(spec.tokens), [str(p) for p in graphed.positions],
                              [str(p) for p in eager.positions], [str(p) for p in config], err, identical))
    return out
