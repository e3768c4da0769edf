"""`tpsim acceptance` as a typed request and the run it asks for: the draft measured on the capture it was trained
on and on the one the engine serves, the config's ids read as triage reads them, the hidden states an SGLang server
returns written out (--returned-hidden-states). The CLI parses argv into an `AcceptanceRequest`; `run_acceptance`
runs from it alone; the printer prints the `AcceptanceResult`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from tpsim.app.acceptance import AcceptanceReport, measure
from tpsim.app.asks import EngineAsk, PromptsAsk, draft_path
from tpsim.app.bounds import check_count, checked_cost
from tpsim.app.preflight import check_output, check_timeout
from tpsim.app.request import Ids, RunRequest
from tpsim.app.returned import returned_paths, write_returned
from tpsim.app.target import check_vocab, target_for
from tpsim.app.triage import Inputs, Triage, config_reading
from tpsim.base.errors import UsageError
from tpsim.draft.checkpoint import runnable
from tpsim.offline.align import read_draft_config
from tpsim.profiles.fingerprints import Unverified, unverified
from tpsim.profiles.history import model_file_server
from tpsim.profiles.returned import RETURNED, Returned


@dataclass(frozen=True)
class AcceptanceRequest:
    """`server`: --server as given; `draft`: the checkpoint directory or a built-in draft's name; `returned`: --returned-hidden-states, whose
    files `outputs` checks before anything runs (`force`: replace them)."""

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


def run_acceptance(req: AcceptanceRequest) -> AcceptanceResult | None:
    """The measurement `req` asks for (None on a torchrun rank other than 0); the prompts, the bounds and the files
    --returned-hidden-states would write are checked once the target and the sequences are known, before any rank
    starts."""
    returned = None if req.returned is None else RETURNED.at(req.server)
    server, replayed_as = model_file_server(req.server, "the radix cache")
    path = draft_path(req.draft)
    ckpt = runnable(path, needs=": acceptance runs the draft's weights")
    config = read_draft_config(str(path))
    target = target_for(config, req.model, list(req.overrides), req.tp, req.run.device)
    if target.standin is not None:
        raise UsageError(f"--model {target.name} is too big to run here and a stand-in's answers say nothing about "
                         "acceptance; give a target that runs here (e.g. --model smollm2-135m), or run on a GPU "
                         "(--device cuda)")
    check_vocab(target, ckpt.config.vocab_size, f"--draft {req.draft}")
    serve, trained, served = req.engine.engines(target.real, server)
    prompts = req.prompts.prompts(target)
    cost = checked_cost(prompts, req.steps, target.real, ckpt.config, req.run, req.tp)
    if req.returned is not None:
        for path in returned_paths(Path(req.returned), len(prompts.sequences) + len(prompts.to_answer)):
            check_output(path, "--returned-hidden-states", "x.safetensors", req.force, reads=(ckpt.path,))
    run = replace(req.run, model=target.name, overrides=req.overrides, tps=tuple(sorted({1, req.tp})),
                  ids=Ids(server=server))
    report = measure(Inputs(trained, serve, served, config, run, target), ckpt, req.steps, prompts, cost)
    if report is None:  # a torchrun rank other than 0
        return None
    report.notes[:0] = [replayed_as] if replayed_as else []
    written = [] if returned is None else write_returned(report, returned, Path(req.returned))
    return AcceptanceResult(report, server, config_reading(report.inputs, report.captures), prompts.origin,
                            unverified(server, target.real.model_type), returned, written)
