"""`tpsim draft` as a typed request and the check it asks for: the checkpoint's layout (or a config alone), what
each named engine version's draft loader does with it and where it reads the ids (else every profiled release at
once), or a copy of the draft out to edit (--copy). The CLI parses argv into a `DraftRequest`; `run_draft` runs from
it alone; the printer prints the `DraftResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tpsim.app.asks import draft_path
from tpsim.base.errors import UsageError
from tpsim.app.draft_copy import copy_draft
from tpsim.app.draft_engines import every_release, ids_findings
from tpsim.app.draft_served import served_findings, target_embedding
from tpsim.app.draft_tp_served import tp_findings
from tpsim.profiles.profile import Platform
from tpsim.draft.checkpoint import inspect, read
from tpsim.draft.findings import DraftFinding
from tpsim.offline.align import read_draft_config
from tpsim.profiles.loader_lines import LINES, lookup
from tpsim.profiles.vllm import loader_assumed
from tpsim.run.spec import ModelSource

SWEPT = ("vLLM's ids read as by the runner a CUDA GPU with Triton gets (--server vllm-cpu@VERSION: a machine without "
         "Triton)")
TRIAGE = ("the served mode and the capture under TP (flags, communication, a trainer other than SpecForge): tpsim "
          "triage --draft-config FILE --server ENGINE@VERSION --model TARGET")
IDS = "which layers the ids capture on the target, against what training captured: give --model TARGET"
WROTE = "the ids were written by SpecForge's current code (triage's default --train): what it captures is the trained"
UNCHECKED = "the weights (fc, embed_tokens, d2t, norms, every tensor's shape): give the draft's directory"


@dataclass(frozen=True)
class DraftRequest:
    """`path`: the draft (a directory, a config file, a built-in name); `servers`: ENGINE[@VERSION] each (none: every
    profiled release); `tp`: the served TP degree."""

    path: str
    model: str | None = None
    servers: tuple[str, ...] = ()
    tp: int = 1
    platform: Platform | None = None  # where SGLang serves it (its verify branch): None, not replayed

    def __post_init__(self) -> None:
        for s in self.servers:  # an unknown engine or version: one line, before anything is read
            if not s or s != s.strip() or " " in s:
                raise UsageError(f"--server {s!r}: {'an empty name' if not s.strip() else 'a name holding a space'} "
                                 "in the list; write ENGINE[@VERSION] names separated by commas alone, e.g. "
                                 "--server sglang@0.5.12,vllm")
            lookup(s)  # a version older than the loaders read is judged UNVERIFIED, a finding saying so


@dataclass(frozen=True)
class CopyRequest:
    """`tpsim draft PATH --copy DIR [--force]`."""

    path: str
    dest: str
    force: bool = False


@dataclass
class DraftResult:
    findings: list[DraftFinding]
    warnings: list[DraftFinding]
    servers: list[str]  # the versions judged, as named (or the releases swept)
    assumed: list[str]
    not_checked: list[str]
    config_alone: bool
    target_hidden: int | None
    replayed: list[str] = field(default_factory=list)  # what the draft under TP showed on real ranks


def run_draft(req: DraftRequest) -> DraftResult:
    servers = [lookup(s) for s in req.servers]
    source = None if req.model is None else ModelSource.load(req.model, [], [])
    hidden = None if source is None else source.cfg.hidden_size
    model_type = "llama" if source is None else source.cfg.model_type
    layers = None if source is None else source.cfg.num_hidden_layers
    ckpt = read(draft_path(req.path), config_alone=True)
    found = inspect(ckpt, hidden)
    embed = None if source is None or not ckpt.weights else target_embedding(source)
    replayed: list[str] = []
    if servers:
        found = served_findings(ckpt, found, servers, embed, req.tp) + ids_findings(ckpt, servers, model_type, layers)
        found += tp_findings(ckpt, servers, embed, req.tp, req.platform, replayed)
    else:
        found = every_release(ckpt, found, embed, req.tp, model_type, layers)
    names = [s.name for s in servers] or [f"every {e} release read ({LINES[e].oldest} to {LINES[e].newest})"
                                          for e in LINES]
    assumed = ([a for s in servers if (a := loader_assumed(s.name)) is not None] if servers else [SWEPT]) + \
        ([] if source is None else [WROTE])
    unchecked = ([] if ckpt.weights else [UNCHECKED]) + ([IDS] if source is None else []) + [TRIAGE]
    return DraftResult([f for f in found if not f.warning], [f for f in found if f.warning], names, assumed,
                       unchecked, not ckpt.weights, hidden, replayed)


def run_copy(req: CopyRequest) -> list[str]:
    """The names copied into `req.dest`."""
    source = draft_path(req.path)
    read_draft_config(str(source))  # a draft config tpsim reads, or one line saying why not
    return copy_draft(source, Path(req.dest), req.force)
