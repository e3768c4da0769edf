"""`tpsim acceptance` over several served configurations at once (repeated --server, or --sweep FILE): the
target's answers and the trained capture's acceptance measured once, every configuration checked before any rank
starts, one rank pool per served TP for all of its configurations, one forward per sequence for the
configurations whose captures differ only in positions, and the draft run once per distinct capture."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tpsim.app.acceptance import (AcceptanceReport, Measured, Prepared, ServedPlan, measure_served, plan_served,
                                  prepare)
from tpsim.app.acceptance_request import AcceptanceRequest, Configured, Setup, configured, setup
from tpsim.app.bounds import checked_cost
from tpsim.app.ranks import on_ranks
from tpsim.app.triage import Triage, captures, config_reading
from tpsim.base.errors import UsageError
from tpsim.base.ui import ProgressLine
from tpsim.base.environ import is_reporting_process
from tpsim.profiles.fingerprints import Unverified, unverified
from tpsim.run.acceptance import captures_many_job


@dataclass(frozen=True)
class SweepRequest:
    """The configurations, each a whole acceptance request, and each one's line as the user gave it; they share the
    draft, the target, the prompts, k, --train and the run options (the CLI builds them from one command line)."""

    configurations: tuple[AcceptanceRequest, ...]
    lines: tuple[str, ...]
    places: tuple[str, ...]  # where each was given ("--sweep FILE line 3"), for its refusal


@dataclass
class SweepRow:
    line: str
    report: AcceptanceReport
    reading: Triage  # how this configuration's server reads the config's ids (config_reading)
    server: str
    stale: Unverified | None


@dataclass
class SweepResult:
    trained: Measured
    rows: list[SweepRow]
    origin: str  # where the prompts came from
    timing: dict = field(default_factory=dict)  # seconds: the shared part, the served captures, the draft runs

    @property
    def ok(self) -> bool:
        return all(r.report.kept and not r.reading.findings for r in self.rows)


def run_sweep(req: SweepRequest) -> SweepResult | None:
    """Every configuration's acceptance against one trained measurement (None on a torchrun rank other than 0)."""
    started = time.perf_counter()
    first = req.configurations[0]
    s = setup(first)
    each = [_configured(c, s, f"{where} ({line})")
            for c, line, where in zip(req.configurations, req.lines, req.places)]
    cost = checked_cost(s.prompts, first.steps, s.target.real, s.checkpoint.config, first.run,
                        max(c.tp for c in req.configurations), passes=1 + len(each))
    also = tuple(c.spec for c in each if c.spec is not None and c.tp == 1)  # along with the trained forward
    prep = prepare(each[0].trained, captures(each[0].trained), s.checkpoint, first.steps, s.prompts, cost, also)
    if prep is None:
        return None
    shared = time.perf_counter()
    plans = [plan_served(prep, c.served, c.caps) for c in each]
    got = _captured(plans, prep)
    if got is None:
        return None
    ran = time.perf_counter()
    measured = _measured(prep, plans, got, req.lines)
    rows = [SweepRow(line, AcceptanceReport(c.served, c.caps, prep.k, prep.sequences, prep.trained, m,
                                            ([c.replayed_as] if c.replayed_as else []) + prep.notes),
                     config_reading(c.served, c.caps), c.server, unverified(c.server, s.target.real.model_type))
            for line, c, m in zip(req.lines, each, measured)]
    done = time.perf_counter()
    return SweepResult(prep.trained, rows, s.prompts.origin,
                       {"shared_s": round(shared - started, 2), "captures_s": round(ran - shared, 2),
                        "draft_s": round(done - ran, 2), "total_s": round(done - started, 2)})


def _configured(req: AcceptanceRequest, s: Setup, given: str) -> Configured:
    try:
        return configured(req, s)
    except UsageError as e:
        raise UsageError(f"{given}: {e}") from None


def _captured(plans: list[ServedPlan], prep: Prepared) -> list[tuple] | None:
    """[((spec, TP), its captures per sequence)], every distinct spec and TP run once, one pool per TP (None on a
    torchrun rank other than 0)."""
    by_tp: dict[int, list] = {}
    out: list[tuple] = [((spec, 1), c) for spec, c in prep.early]
    for p in plans:
        if p.spec is not None and prep.captured(p.spec, p.fed.tp) is None and \
                p.spec not in by_tp.setdefault(p.fed.tp, []):
            by_tp[p.fed.tp].append(p.spec)
    for tp, specs in sorted(by_tp.items()):
        got = on_ranks(captures_many_job, specs[0], tp, specs=specs, tp=tp,
                       sequences=[list(q.tokens) for q in prep.sequences])
        if got is None:
            return None
        out += zip(((spec, tp) for spec in specs), next(r for r in got.values() if r is not None))
    return out


def _measured(prep: Prepared, plans: list[ServedPlan], got: list[tuple], lines: tuple[str, ...]) -> list[Measured]:
    """Each configuration's acceptance, the draft run once per distinct capture, embedding and stale KV."""
    progress = ProgressLine(enabled=is_reporting_process())
    seen: list[tuple] = []
    out = []
    for i, (p, line) in enumerate(zip(plans, lines)):
        key = (p.spec, p.fed.tp, id(p.embed), [str(x) for x in p.stale], p.fed.embedding, p.fed.cache)
        again = next((m for k, m in seen if k == key), None) if p.spec is not None else None
        if again is not None:
            out.append(Measured(p.fed, again.acceptance, again.ranks_identical, again.rounds, again.captures))
        else:
            on_serve = next((c for at, c in got if at == (p.spec, p.fed.tp)), None) if p.spec else None
            out.append(measure_served(prep, p, on_serve))
            seen.append((key, out[-1]))
        a = out[-1].acceptance
        progress(f"configuration {i + 1}/{len(plans)}: {line}: "
                 + (f"AL {a.length:.3f}" if a is not None else f"not measured: {out[-1].fed.failure}"))
    progress.stop()
    return out
