"""`tpsim acceptance` as a typed request and the run it asks for: the draft measured on the capture it was trained
on and on the one the engine serves, the config's ids read as triage reads them, the hidden states an SGLang server
returns written out (--returned-hidden-states). The CLI parses argv into an `AcceptanceRequest`; `run_acceptance`
runs from it alone; the printer prints the `AcceptanceResult`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tpsim.app.acceptance import AcceptanceReport, measure, served_fed, served_spec
from tpsim.app.prompts import Prompts
from tpsim.app.asks import EngineAsk, PromptsAsk, draft_path
from tpsim.app.bounds import check_count, checked_cost
from tpsim.app.preflight import check_output, check_timeout
from tpsim.app.request import Ids, RunRequest
from tpsim.app.returned import returned_paths, write_returned
from tpsim.app.target import Target, check_vocab, target_for
from tpsim.app.remedies import with_draft_ids
from tpsim.app.triage import Captures, Inputs, Triage, captures, config_reading
from tpsim.base.errors import UsageError
from tpsim.draft.checkpoint import DraftCheckpoint, runnable
from tpsim.offline.align import DraftConfig, read_draft_config
from tpsim.profiles.fingerprints import Unverified, unverified
from tpsim.profiles.history import model_file_server
from tpsim.profiles.returned import RETURNED, Returned
from tpsim.run.spec import RunSpec


@dataclass(frozen=True)
class AcceptanceRequest:
    """`server`: --server as given; `draft`: the checkpoint directory or a built-in draft's name; `returned`: --returned-hidden-states, whose
    files `outputs` checks before anything runs (`force`: replace them); `draft_ids`: --draft-ids, the values
    the served draft config holds at the key `server` reads first instead of its own (training read the config as
    it is)."""

    server: str
    engine: EngineAsk
    draft: str
    model: str | None = None
    overrides: tuple[str, ...] = ()
    steps: int = 3
    prompts: PromptsAsk = PromptsAsk()
    returned: str | None = None
    force: bool = False
    run: RunRequest = RunRequest()
    draft_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_timeout(self.run.timeout)
        check_count(self.steps, "--steps")

    @property
    def tp(self) -> int:
        return self.engine.served.tp


@dataclass
class AcceptanceResult:
    report: AcceptanceReport
    server: str  # the --server whose model file replays the capture
    reading: Triage  # how the server reads the config's ids, as triage says it (config_reading)
    origin: str  # where the prompts came from
    stale: Unverified | None
    returned: Returned | None
    written: list[Path]

    @property
    def ok(self) -> bool:
        return self.report.kept and not self.reading.findings


@dataclass(frozen=True)
class Setup:
    """What every served configuration of one command shares: the draft (its weights and its config as given),
    the target and the prompts."""

    checkpoint: DraftCheckpoint
    config: DraftConfig
    target: Target
    prompts: Prompts


@dataclass(frozen=True)
class Configured:
    """One served configuration, checked: the inputs training's capture is read from (the draft config as given)
    and those the engine serves from (its ids as --draft-ids writes them), the --server whose model file replays
    it and what that replay assumed."""

    trained: Inputs
    served: Inputs
    server: str
    replayed_as: str | None
    spec: RunSpec | None  # what replays the served capture (None: the engine feeds the draft nothing)
    tp: int
    caps: Captures  # the served capture as read and replayed (no rank runs for it)


def setup(req: AcceptanceRequest) -> Setup:
    path = draft_path(req.draft)
    ckpt = runnable(path, needs=": acceptance runs the draft's weights")
    config = read_draft_config(str(path))
    target = target_for(config, req.model, list(req.overrides), req.tp, req.run.device)
    if target.standin is not None:
        raise UsageError(f"--model {target.name} is too big to run here and a stand-in's answers say nothing about "
                         "acceptance; give a target that runs here (e.g. --model smollm2-135m), or run on a GPU "
                         "(--device cuda)")
    check_vocab(target, ckpt.config.vocab_size, f"--draft {req.draft}")
    return Setup(ckpt, config, target, req.prompts.prompts(target))


def configured(req: AcceptanceRequest, s: Setup) -> Configured:
    """`req`'s served configuration on `s`, every check that needs no rank done (UsageError, one line)."""
    server, replayed_as = model_file_server(req.server, "the radix cache")
    s.target.source.cfg.check_tp(req.tp)
    serve, trained, served = req.engine.engines(s.target.real, server)
    run = replace(req.run, model=s.target.name, overrides=req.overrides, tps=tuple(sorted({1, req.tp})),
                  ids=Ids(server=server))
    as_given = Inputs(trained, serve, served, s.config, run, s.target)
    as_served = as_given if req.draft_ids is None else with_draft_ids(as_given, req.draft_ids)
    caps = captures(as_served)
    fed = served_fed(as_served, caps, s.checkpoint.config.capture_width)
    return Configured(as_given, as_served, server, replayed_as, served_spec(as_served, fed), fed.tp, caps)


def run_acceptance(req: AcceptanceRequest) -> AcceptanceResult | None:
    """The measurement `req` asks for (None on a torchrun rank other than 0); the prompts, the bounds and the files
    --returned-hidden-states would write are checked once the target and the sequences are known, before any rank
    starts."""
    returned = None if req.returned is None else RETURNED.at(req.server)
    s = setup(req)
    c = configured(req, s)
    cost = checked_cost(s.prompts, req.steps, s.target.real, s.checkpoint.config, req.run, req.tp)
    if req.returned is not None:
        for path in returned_paths(Path(req.returned), len(s.prompts.sequences) + len(s.prompts.to_answer)):
            check_output(path, "--returned-hidden-states", "x.safetensors", req.force, reads=(s.checkpoint.path,))
    report = measure(c.trained, s.checkpoint, req.steps, s.prompts, cost, c.served, c.caps)
    if report is None:  # a torchrun rank other than 0
        return None
    report.notes[:0] = [c.replayed_as] if c.replayed_as else []
    written = [] if returned is None else write_returned(report, returned, Path(req.returned))
    return AcceptanceResult(report, c.server, config_reading(report.inputs, report.captures), s.prompts.origin,
                            unverified(c.server, s.target.real.model_type), returned, written)
