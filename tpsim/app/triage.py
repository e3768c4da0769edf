"""`tpsim triage`'s verdict: from the align report (train vs serve, read from the draft config as
each program reads it), the serving engine's replay of its ids, the mode its flags and auto-enable
rules put it in, and the check run in that mode, the findings: each with its cause, the sources
that show the engine does this, and a concrete fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpsim.app.check import run_check
from tpsim.app.request import RunRequest
from tpsim.app.run_options import pipeline_for, pp_refusal, pp_replay
from tpsim.offline.align import DraftConfig, Report
from tpsim.profiles.draft import ConfigIds, write_ids_hint
from tpsim.profiles.findings import Finding, Kind, replay_findings
from tpsim.profiles.resolution import resolution
from tpsim.profiles.profile import GraphIds, Profile, Served
from tpsim.profiles.registry import later_profiles
from tpsim.profiles.replay import Replay, replay
from tpsim.profiles.served import ServedMode, fixed_in, served_mode
from tpsim.offline.sides import align_profiles, ids_capturing, side_from_config
from tpsim.run.spec import ModelSource
from tpsim.app.report import CheckReport, Failure


@dataclass
class Triage:
    train: Profile
    serve: Profile
    served: Served
    mode: ServedMode
    align: Report
    config: ConfigIds  # what the server read from the draft config
    replay: Replay
    check: CheckReport | None  # None: nothing to run (the engine captures nothing)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings


def triage(train: Profile, serve: Profile, served: Served, draft: DraftConfig, request: RunRequest,
           source: ModelSource) -> Triage | None:
    """The draft read as the trainer and the server each read it, the two captures aligned, the mode the
    served flags put the engine in, and check run in that mode on the target's shape (None on a
    torchrun rank other than 0)."""
    L = source.cfg.num_hidden_layers
    train_side, _ = side_from_config("train", train, draft, L)
    serve_side, got = side_from_config("serve", serve, draft, L)
    report = align_profiles(train_side, serve_side, serve)
    rep = replay(serve, got.ids, L)
    mode = served_mode(serve, served)
    check, refused = None, pp_refusal(request.pipeline, request.ids.server, source.cfg)
    if rep.positions and not got.off and rep.failure is None and refused is None:
        res = resolution(rep, got.ids)
        if request.pipeline.size > 1:  # what reaches the draft under the engine's pipeline
            pp_replay(pipeline_for(request.pipeline, request.ids.server, source.cfg, list(request.tps), mode.mode),
                      request.ids.server, res, source.cfg)
        spec, _ = request.spec(source, tuple(res.positions), (mode.mode, mode.strategy))
        check = run_check(spec, res, list(request.tps))
        if check is None:
            return None
    t = Triage(train, serve, served, mode, report, got, rep, check)
    if refused is not None:
        t.findings.append(Finding(Kind.ENGINE_REFUSES, refused.cause, [refused.source], refused.fix))
        return t
    assess(t, source.cfg.hidden_size)
    return t


def assess(t: Triage, hidden: int) -> None:
    """Fill t.findings (in the order a user should fix them) and t.notes."""
    serve, rep, got = t.serve, t.replay, t.config
    if got.off:
        t.findings.append(Finding(Kind.CAPTURE_OFF, got.failure, [str(serve.behaviour.config.source)],
                                  "remove use_aux_hidden_state: false from eagle_config (an EAGLE-3 draft needs "
                                  "the aux hidden states)"))
        return
    t.findings += replay_findings(rep, hidden)
    t.findings += _fallbacks(t)
    t.findings += _misaligned(t)
    t.findings += _served_mode(t)
    t.findings += [Finding(Kind.PIPELINE, *_cause_fix(f, t.serve))
                   for f in (t.check.resolution.findings if t.check is not None else []) if f.startswith("pipeline")]
    t.findings += _graphs(t)


def _cause_fix(finding: str, serve: Profile) -> tuple[str, list[str], str]:
    cause, _, fix = finding.partition("; fix: ")
    return cause, [str(serve.behaviour.pp.source)], fix


def _fallbacks(t: Triage) -> list[Finding]:
    """The server ignores ids the config holds at a key it does not read, and what that changes."""
    got, ignored = t.config, t.config.ignored
    if got.fallback is None:
        return []
    meant = replay(t.train, ignored, t.replay.num_layers)  # what those ids capture read as the trainer reads them
    if meant.failure or meant.positions == t.replay.positions:
        t.notes.append(f"{got.fallback}; its default captures what those ids would, so this works by coincidence")
        return []
    return [Finding(Kind.KEY_FALLBACK,
                    f"{got.fallback}: it captures its default {_pos(t.replay)} where the config's ids, read as "
                    f"{t.train.name} reads them, name {_pos(meant)}",
                    [str(t.serve.behaviour.config.source), str(t.train.behaviour.config.source)],
                    _fix_ids(t, meant, ignored) or "move the ids to the key the server reads")]


def _fix_ids(t: Triage, want: Replay, written: list[int]) -> str | None:
    """Where to write ids the server reads that capture `want` (the written ids, when they do)."""
    ids = ids_capturing(t.serve, want.positions, want.num_layers, prefer=written)
    return None if ids is None else write_ids_hint(t.serve, ids) + f" (captures {_pos(want)})"


def _misaligned(t: Triage) -> list[Finding]:
    """Train and serve differ for a reason other than what the findings above already say."""
    said = {"unreachable", "slot-count", "default-fallback"}
    reasons = [r for r in t.align.reasons if r.code not in said]
    if t.align.aligned or not reasons or any(f.kind is Kind.KEY_FALLBACK for f in t.findings) and \
            all(r.code in ("different-layer", "off-by-one") for r in reasons):
        return []
    fix = t.align.fix.text if t.align.fix is not None else "no server ids capture the trained tensors"
    return [Finding(Kind.MISALIGNED, "; ".join(str(r) for r in reasons),
                    [str(t.serve.behaviour.numbering.source), str(t.train.behaviour.numbering.source)], fix)]


def _served_mode(t: Triage) -> list[Finding]:
    if t.check is None or all(r.ok for r in t.check.rows):
        return []
    fails = "; ".join(f"TP={r.tp}: {f}" for r in t.check.rows for f in _grouped(r.findings))
    later = fixed_in(t.serve, later_profiles(t.serve), t.mode)
    fix = (f"{_upgrade(later)} captures the whole reduced stream in this mode" if later else
           "no version tpsim knows captures the whole stream in this mode")
    return [Finding(Kind.SERVED_MODE,
                    f"{'; '.join(t.mode.why)}; replayed as mode {t.mode.mode.name}, capture strategy "
                    f"{t.mode.strategy}: {fails}", [str(c.source) for c in t.mode.decided_by], fix)]


def _grouped(failures: list[Failure]) -> list[str]:
    """`out(1): X`, `out(3): X` -> `out(1), out(3): X` (one line per distinct reason)."""
    by_reason: dict[str, list[str]] = {}
    for f in failures:
        why = f.text if f.where else str(f)
        if f.where and why.count(": ") >= 2:  # drop the per-position tail ("... they are out(3)")
            why = why.rsplit(": ", 1)[0]
        by_reason.setdefault(why, []).append(f.where or "")
    return [(", ".join(w for w in wheres if w) + ": " if any(wheres) else "") + why
            for why, wheres in by_reason.items()]


def _graphs(t: Triage) -> list[Finding]:
    g = t.serve.behaviour.graphs
    if g is None or g.value is GraphIds.CONFIG or not t.served.cuda_graph or t.replay.used_default:
        return []
    default = replay(t.serve, None, t.replay.num_layers)
    if g.value is GraphIds.DEFAULT and default.positions == t.replay.positions:
        return []
    got = "nothing" if g.value is GraphIds.NONE else _pos(default)
    later = next((q for q in later_profiles(t.serve) if q.behaviour.graphs and
                  q.behaviour.graphs.value is GraphIds.CONFIG), None)
    return [Finding(Kind.GRAPH_IDS, f"CUDA-graphed (decode) batches capture {got}, not the configured "
                                    f"{_pos(t.replay)}: {g.value.value}", [str(g.source)],
                    _upgrade(later) if later else "no fixed version known")]


def _upgrade(q: Profile) -> str:
    """`sglang@0.5.14 or later (#28343, #28789)`: the engine version that has the fix."""
    return f"{q.name.split(':')[0]} or later ({q.versions.since.label})"


def _pos(rep: Replay) -> str:
    return ", ".join(map(str, rep.positions)) or "nothing"
