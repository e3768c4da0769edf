"""`tpsim align` as a typed request and the comparison it asks for: the trainer's and the server's captures, from
CONVENTION:IDS on each side or from a draft config read as each program reads it, on a layer count or on a target
that is run (--model: the cosine per slot). The CLI parses argv into an `AlignRequest`; `run_align` runs from it
alone; the printer prints the `AlignResult`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn.functional as F

from tpsim.app.preflight import check_timeout
from tpsim.app.ranks import is_reporting_process, on_ranks
from tpsim.app.request import RunRequest
from tpsim.base.errors import UsageError
from tpsim.capture import Position
from tpsim.config.loader import DEFAULT_MODEL_TYPE
from tpsim.offline.align import ModelRun, Report, Slot, align, make_side, read_draft_config
from tpsim.offline.sides import align_profiles, side_from_config
from tpsim.profiles.conventions import parse_convention_ids, refuse_convention_as_profile
from tpsim.profiles.draft import write_ids_hint
from tpsim.profiles.fingerprints import Unverified, unverified
from tpsim.profiles.profile import Profile
from tpsim.profiles.registry import lookup, serving
from tpsim.profiles.vllm import assumed
from tpsim.run.jobs import capture_job
from tpsim.run.spec import ModelSource


@dataclass(frozen=True)
class AlignRequest:
    """Either `train` and `serve` (CONVENTION:IDS each), or `draft_config` with `server` (and `train`, a trainer's
    profile, default SpecForge's; `train_option` the option that named it); the layer count from `num_layers` or
    from `model`, which is then run at TP `tp` with `run`'s execution options."""

    train: str | None = None
    serve: str | None = None
    draft_config: str | None = None
    server: str | None = None
    num_layers: int | None = None
    model: str | None = None
    overrides: tuple[str, ...] = ()
    tp: int = 1
    run: RunRequest = RunRequest()
    train_option: str = "--train"

    def __post_init__(self) -> None:
        by_config = self.draft_config is not None or self.server is not None
        by_ids = self.serve is not None or (self.train is not None and not by_config)
        if by_ids and by_config:
            raise UsageError("give either --train/--serve or --draft-config/--trainer/--server, not both")
        if not by_ids and not by_config:
            raise UsageError("nothing to align: give --train CONVENTION:IDS --serve CONVENTION:IDS, or "
                             "--draft-config PATH --server sglang|vllm")
        for opt, v in (("--train", self.train), ("--serve", self.serve)) if by_ids else ():
            if v is None:
                raise UsageError(f"{opt} is missing; give both --train CONVENTION:IDS and --serve CONVENTION:IDS")
        if by_config and self.draft_config is None:
            raise UsageError("--server with a draft's ids reads its config: give --draft-config PATH (the draft's "
                             "config.json), or compare conventions with --train CONVENTION:IDS --serve CONVENTION:IDS")
        if by_config and self.server is None:
            raise UsageError("--draft-config needs --server PROFILE, e.g. --server sglang or --server vllm@0.25.0 "
                             "(tpsim profiles lists them)")
        if (self.num_layers is None) == (self.model is None):
            raise UsageError("align needs the target's layer count: give --num-layers L or --model M (not both)")
        if self.overrides and self.model is None:
            raise UsageError("--override changes the --model config; give --model too")
        if self.model is not None:
            check_timeout(self.run.timeout)


@dataclass
class AlignResult:
    report: Report
    serve: Profile | None  # the serving profile, when the sides come from a draft config
    stale: Unverified | None
    model_file: str | None = None  # what was assumed for the model file when nothing named it

    @property
    def assumptions(self) -> list[str]:
        runner = None if self.serve is None else assumed(self.serve)
        return [a for a in (self.model_file, runner) if a is not None]


def run_align(req: AlignRequest) -> AlignResult | None:
    """The comparison `req` asks for (None on a torchrun rank other than 0)."""
    src = None if req.model is None else ModelSource.load(req.model, list(req.overrides), [req.tp])
    L = req.num_layers if src is None else src.cfg.num_hidden_layers
    kind = DEFAULT_MODEL_TYPE if src is None else src.cfg.model_type
    report, serve_p = sides(req, L, kind)
    if src is not None:
        report.run = run_model(req, src, report)
        if not is_reporting_process():
            return None
    if report.fix is not None and report.fix.ids is not None:
        report.fix.text += f" ({fix_hint(report, serve_p)})"
    named = src is not None or serve_p is None or ":" in req.server.partition("+")[0]
    chosen = None if named else (f"the model file: {serve_p.family} (--num-layers names no model; the default's); "
                                 f"name it with --server {req.server.partition(':')[0]}:MODEL (e.g. :qwen2, :llama) "
                                 "or give --model")
    return AlignResult(report, serve_p, None if serve_p is None else unverified(req.server, kind), chosen)


def sides(req: AlignRequest, L: int, kind: str) -> tuple[Report, Profile | None]:
    """The report, and the serving profile when the sides come from a draft config."""
    if req.draft_config is None:
        out = []
        for role, text in (("train", req.train), ("serve", req.serve)):
            conv, ids = parse_convention_ids(text, f"--{role}")
            out.append(make_side(role, conv, ids, L, f"--{role} {text}"))
        return align(out[0], out[1]), None
    draft = read_draft_config(req.draft_config)
    serve_p = serving(req.server, kind)
    if ":" in req.server:  # the server names the model: the trainer trained for the same one
        kind = req.server.partition("+")[0].partition(":")[2].strip()
    train_p = lookup(refuse_convention_as_profile(req.train or "specforge", req.train_option), kind)
    train, _ = side_from_config("train", train_p, draft, L)
    serve, _ = side_from_config("serve", serve_p, draft, L)
    return align_profiles(train, serve, serve_p), serve_p


def fix_hint(report: Report, serve: Profile | None) -> str:
    ids = report.fix.ids
    if serve is None:
        return f"--serve {report.serve.convention}:{','.join(map(str, ids))}"
    return write_ids_hint(serve, ids)


def run_model(req: AlignRequest, src: ModelSource, report: Report) -> ModelRun | None:
    """Capture every position either side names once, at TP=`req.tp`, and set each slot's cosine (mean over tokens)
    between the feature training saw and the one the server captures."""
    union = sorted({p for side in (report.train, report.serve) for p in side.positions if p is not None},
                   key=Position.sort_key)
    tp = req.tp
    spec, _ = replace(req.run, model=req.model, overrides=req.overrides, tps=(tp,)).spec(src, tuple(union))
    info = ModelRun(req.model, src.weights, src.fingerprint, tp, spec.dtype, req.run.seed, len(spec.tokens),
                    [str(p) for p in union], list(src.notes))
    if not union:
        return info
    results = on_ranks(capture_job, spec, tp, tp=tp)
    if results is None:
        return None
    got = [r for r in results.values() if r is not None]
    cap = next(r.capture for r in got if r.capture is not None)
    info.identical_on_ranks = all(r.identical for r in got)
    set_cosines(report.slots, cap, union, src.cfg.hidden_size)
    return info


def set_cosines(slots: list[Slot], cap, union: list[Position], H: int) -> None:
    """cos(train feature, serve feature) per token, averaged, in float64, for every slot both sides reach."""
    for s in slots:
        if s.train is None or s.serve is None or s.train.position is None or s.serve.position is None:
            continue
        a, b = (cap[:, k * H:(k + 1) * H].double() for k in
                (union.index(s.train.position), union.index(s.serve.position)))
        s.cosine = float(F.cosine_similarity(a, b, dim=-1).mean())
