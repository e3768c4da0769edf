"""`check --disaggregate P:D`: SGLang's PD-disaggregation hand-off of the EAGLE-3 draft's state, replayed
on real ranks (tpsim.run.pd_jobs), judged: the engine's failure where the version's widths disagree
(a Finding naming both widths, the PRs and the fix), else every decode rank's buffer bitwise equal to
what the prefill server sent."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.app.preflight import check_world
from tpsim.app.ranks import on_ranks
from tpsim.base.errors import UsageError
from tpsim.profiles.findings import Finding, Kind
from tpsim.profiles.pd import Widths
from tpsim.profiles.history import model_file_server
from tpsim.profiles.pd_versions import PdVersion, pd_version
from tpsim.run.pd_jobs import Disaggregation, PdRank, pd_job
from tpsim.run.spec import RunSpec


@dataclass(frozen=True)
class PdAsk:
    """--disaggregate P:D and --draft-hidden (None: the target's hidden size)."""

    prefill: int
    decode: int
    draft_hidden: int | None = None


def capture_server(server: str) -> tuple[str, str | None]:
    """The --server whose model file replays the capture (tpsim.profiles.history.model_file_server)."""
    return model_file_server(server, "the PD hand-off")


def plan(ask: PdAsk, server: str, spec: RunSpec, ignore_limits: bool) -> tuple[Disaggregation, PdVersion]:
    """The hand-off to replay: the version's behaviour at this target's and draft's widths."""
    version = pd_version(server)
    H = spec.cfg.hidden_size
    draft = H if ask.draft_hidden is None else ask.draft_hidden
    if not spec.positions:
        raise UsageError("--disaggregate replays an EAGLE-3 draft's hand-off: the capture needs ids")
    widths = Widths(H, draft, len(spec.positions))
    check_world(ask.prefill + ask.decode, spec.device, ignore_limits, f"--disaggregate {ask.prefill}:{ask.decode}")
    cited = version.cited
    why = f"{server}: {cited.value.value} ({version.versions.text()}; {cited.source})"
    return Disaggregation(ask.prefill, ask.decode, cited.value, widths, why), version


@dataclass
class PdReport:
    """What the replayed hand-off did: each rank's part, the engine's failure (a Finding), whether every
    decode rank holds what was sent, bitwise."""

    pd: Disaggregation
    version: PdVersion
    ranks: list[PdRank]
    finding: Finding | None = None
    mismatched: list[int] = field(default_factory=list)  # decode ranks whose buffer differs from what was sent

    @property
    def ok(self) -> bool:
        return self.finding is None and not self.mismatched

    @property
    def sender(self) -> PdRank:
        return next(r for r in self.ranks if r.rank == 0)

    def decoders(self) -> list[PdRank]:
        return [r for r in self.ranks if not r.prefill]


def run_pd(spec: RunSpec, pd: Disaggregation, version: PdVersion) -> PdReport | None:
    """The hand-off on P + D real ranks, judged (None on torchrun ranks other than 0)."""
    results = on_ranks(pd_job, spec, pd.world, pd=pd)
    if results is None:
        return None
    report = PdReport(pd, version, sorted((r for r in results.values() if r is not None), key=lambda r: r.rank))
    sent = report.sender
    if sent.failure:
        report.finding = finding(pd, version, sent.failure)
    else:
        report.mismatched = [r.rank for r in report.decoders()
                             if r.received is None or not torch.equal(r.received, sent.sent)]
    return report


def finding(pd: Disaggregation, version: PdVersion, said: str) -> Finding:
    w, t = pd.widths, pd.transfer
    cause = (f"PD disaggregation: the prefill server sends {t.sent_text(w)} values per request ({t.what}) into the "
             f"decode server's {t.buffer(w)}-wide buffer: {version.failure(w) or 'shape error'}; replayed: the copy "
             f"into the {t.buffer(w)}-wide buffer (MetadataBuffers.set_buf) fails in torch: {said}")
    return Finding(Kind.PD_HANDOFF, cause, [str(version.cited.source)], version.fix())
