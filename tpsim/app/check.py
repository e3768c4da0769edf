"""`check`'s runs: the capture check at every degree (or over --pp stages), and --cuda-graph's
graphed batch, each on real ranks."""

from __future__ import annotations

from tpsim.app.ranks import on_ranks
from tpsim.app.report import CheckReport, summarize
from tpsim.profiles.resolution import Resolution
from tpsim.run.graph_jobs import graph_job
from tpsim.run.graphs import GraphCheck
from tpsim.run.jobs import check_job
from tpsim.run.pp_jobs import pp_check_job
from tpsim.run.spec import RunSpec


def run_check(spec: RunSpec, res: Resolution, tps: list[int]) -> CheckReport | None:
    """Run check_job at every degree in `tps` on real ranks (None on torchrun ranks other than 0)."""
    pp = spec.pipeline.size if spec.pipeline else 1
    results = on_ranks(check_job if pp == 1 else pp_check_job, spec, pp * max(tps), tps=tps)
    if results is None:
        return None
    return summarize(spec, res, tps, [r for per_rank in results.values() for r in per_rank])


def run_graphs(spec: RunSpec, tps: list[int]) -> list[GraphCheck] | None:
    """--cuda-graph: graph_job at every degree (None on torchrun ranks other than 0)."""
    results = on_ranks(graph_job, spec, max(tps), tps=tps)
    return None if results is None else [c for per_rank in results.values() for c in per_rank]
