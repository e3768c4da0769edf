"""`tpsim triage` as a typed request and the run it asks for: the draft config read as the trainer and the server
read it, check in the served mode, every fix and the PLAN replayed, the checkpoint judged, the acceptance measured
(--measure). The CLI parses argv into a `TriageRequest`; `run_triage` runs from it alone; the printer prints the
`TriageResult`."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tpsim.app.acceptance import TriageMeasure, measure_triage
from tpsim.app.asks import EngineAsk, PromptsAsk
from tpsim.app.bounds import check_count, checked_cost
from tpsim.app.draft_served import served_findings, target_embedding
from tpsim.app.preflight import check_divides_world, check_timeout
from tpsim.app.remedies import Plan, plan, replay_fixes
from tpsim.app.request import Ids, RunRequest
from tpsim.app.target import Target, check_vocab, target_for
from tpsim.app.triage import Inputs, Triage, triage
from tpsim.base.errors import UsageError
from tpsim.base.ui import step
from tpsim.draft.checkpoint import inspect, read, runnable
from tpsim.draft.findings import DraftFinding
from tpsim.offline.align import read_draft_config
from tpsim.profiles.fingerprints import Unverified, unverified
from tpsim.profiles.history import model_file_server
from tpsim.profiles.loader_lines import lookup


@dataclass(frozen=True)
class TriageRequest:
    """`server`: --server as given; `draft`: a checkpoint directory (--draft), else `draft_config` alone; `run`: the
    execution options (its model, degrees and ids are set from the draft and the served TP)."""

    server: str
    engine: EngineAsk
    draft: str | None = None
    draft_config: str | None = None
    model: str | None = None
    overrides: tuple[str, ...] = ()
    measure: bool = False
    steps: int = 3
    prompts: PromptsAsk = PromptsAsk()
    run: RunRequest = RunRequest()

    def __post_init__(self) -> None:
        check_timeout(self.run.timeout)
        check_count(self.steps, "--steps")
        check_divides_world(self.tp)
        if (self.draft is None) == (self.draft_config is None):
            raise UsageError("triage reads the draft: give --draft-config FILE (its config.json), or --draft DIR")
        if self.measure and self.draft is None:
            raise UsageError("--measure runs the draft: give its checkpoint directory with --draft DIR instead of "
                             "--draft-config")

    @property
    def tp(self) -> int:
        return self.engine.served.tp

    @property
    def config_path(self) -> str:
        """What the header names and the ids are read from."""
        return self.draft if self.draft is not None else self.draft_config


@dataclass
class TriageResult:
    t: Triage
    server: str  # the --server whose model file replays the capture
    checkpoint: list[DraftFinding]
    measured: TriageMeasure | None
    plan: Plan | None
    stale: Unverified | None

    @property
    def ok(self) -> bool:
        return self.t.ok and not self.checkpoint


def run_triage(req: TriageRequest) -> TriageResult | None:
    """The triage `req` asks for (None on a torchrun rank other than 0)."""
    server, replayed_as = model_file_server(req.server, "the radix cache and the PD hand-off")
    ckpt = None if req.draft is None else (runnable if req.measure else read)(
        req.draft, needs=": --draft runs the draft's weights")
    draft = read_draft_config(req.config_path)
    target = target_for(draft, req.model, list(req.overrides), req.tp)
    if req.measure and target.standin is not None:
        raise UsageError(f"--measure runs the target, and {target.name} is too big to run here (triage replays it on "
                         "a stand-in, whose answers say nothing about acceptance); drop --measure, or give a target "
                         "that runs here with --model")
    if req.measure:
        check_vocab(target, ckpt.config.vocab_size, f"--draft {req.draft}")
    cfg = target.real
    serve_p, trained, served = req.engine.engines(cfg, server)
    prompts = req.prompts.prompts(target) if req.measure else None
    cost = checked_cost(prompts, req.steps, cfg, ckpt.config, req.run, req.tp) if req.measure else None
    tps = sorted({1, req.tp})
    run = replace(req.run, model=target.name, overrides=req.overrides, tps=tuple(tps),
                  ids=Ids(server=server, draft_config=req.config_path))
    with step(f"triage: check at TP {', '.join(map(str, tps))}"):
        t = triage(Inputs(trained, serve_p, served, draft, run, target))
    if t is None:  # a torchrun rank other than 0
        return None
    t.notes[:0] = [replayed_as] if replayed_as else []
    tried: dict = {}
    replay_fixes(t, tried)
    best = plan(t, tried)
    checkpoint = [] if ckpt is None else served_findings(
        ckpt, inspect(ckpt, cfg.hidden_size), [lookup(server.partition("+")[0])], _embedding(target), served.tp)
    measured = None if not req.measure else measure_triage(t, ckpt, req.steps, prompts, cost)
    if req.measure and measured is None:
        return None
    return TriageResult(t, server, checkpoint, measured, best, unverified(server, cfg.model_type))


def _embedding(target: Target):
    return target_embedding(target.source) if target.standin is None else None
