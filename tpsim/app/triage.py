"""`tpsim triage`'s verdict: from the align report (train vs serve: the draft config as each program
reads it, or the ids training used as the user gives them), the serving engine's replay of its ids,
the mode its flags and auto-enable rules put it in, and the check run in that mode, the findings: each
with its cause, the sources that show the engine does this, and a fix that triage has applied and
replayed (tpsim.app.remedies)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tpsim.app.check import run_check
from tpsim.app.request import RunRequest
from tpsim.app.run_options import pipeline_for, pp_refusal, pp_replay
from tpsim.app.target import Target
from tpsim.offline.align import DraftConfig, Report, Side, make_side
from tpsim.profiles.conventions import Convention
from tpsim.profiles.draft import ConfigIds, write_ids_hint
from tpsim.profiles.findings import Finding, Kind, replay_findings
from tpsim.profiles.resolution import resolution
from tpsim.capture.positions import Position, PositionKind
from tpsim.profiles.profile import GraphIds, Patch, Profile, Served
from tpsim.profiles.registry import later_profiles, patched
from tpsim.profiles.replay import Replay, replay
from tpsim.profiles.served import ServedMode, fixed_in, served_mode
from tpsim.offline.sides import align_profiles, ids_capturing, side_from_config
from tpsim.app.report import CheckReport, Failure
from tpsim.app.served_flags import (algorithm_findings, fc_findings, pd_findings, radix_findings, ubatch_findings,
                                    unread_notes)


@dataclass(frozen=True)
class Trained:
    """What trained the draft: a trainer's profile reading the draft config, or the ids training used
    as the user knows them, in a convention's numbering (`--train specforge-ids:1,29,57`)."""

    profile: Profile
    convention: Convention | None = None
    ids: tuple[int, ...] | None = None
    spelled: str = ""

    @property
    def name(self) -> str:
        return self.spelled if self.convention is not None else self.profile.name


@dataclass(frozen=True)
class Inputs:
    """Everything a triage runs on; a fix is a change to these (tpsim.app.remedies)."""

    trained: Trained
    serve: Profile
    served: Served
    draft: DraftConfig
    request: RunRequest
    target: Target


@dataclass
class Triage:
    inputs: Inputs
    mode: ServedMode
    align: Report
    config: ConfigIds  # what the server read from the draft config
    replay: Replay
    check: CheckReport | None  # None: nothing to run (no position to check)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fixes: dict = field(default_factory=dict)  # finding index -> the replayed change (tpsim.app.remedies.Remedy)
    left: dict = field(default_factory=dict)  # finding index -> the findings its fix alone leaves (a partial fix)
    warnings: list[str] = field(default_factory=list)  # works, by luck: each with the change that makes it hold

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def train(self) -> Profile:
        return self.inputs.trained.profile

    @property
    def serve(self) -> Profile:
        return self.inputs.serve

    @property
    def served(self) -> Served:
        return self.inputs.served


@dataclass(frozen=True)
class Captures:
    """The two captures a triage compares: what training captured and what the server captures (the ids
    it read from the config, their replay, the mode its flags put it in), aligned."""

    train: Side
    config: ConfigIds
    replay: Replay
    mode: ServedMode
    align: Report

    @property
    def trained_positions(self) -> list[Position]:
        return [p for p in self.train.positions if p is not None]


def captures(inputs: Inputs) -> Captures:
    train, serve, draft = inputs.trained, inputs.serve, inputs.draft
    L = inputs.target.source.cfg.num_hidden_layers
    serve_side, got = side_from_config("serve", serve, draft, L)
    train_side = side_from_config("train", train.profile, draft, L)[0] if train.ids is None else \
        make_side("train", train.convention, list(train.ids), L, f"--train {train.spelled}")
    return Captures(train_side, got, replay(serve, got.ids, L), served_mode(serve, inputs.served),
                    align_profiles(train_side, serve_side, serve))


def triage(inputs: Inputs) -> Triage | None:
    """The draft read as the trainer and the server each read it, the two captures aligned, the mode the
    served flags put the engine in, and check run in that mode on the target's shape (None on a
    torchrun rank other than 0). Where the served ids capture nothing (a crash, capture off), the check
    runs on the positions training used: what the draft needs the mode to deliver."""
    serve, request, source = inputs.serve, inputs.request, inputs.target.source
    sides = captures(inputs)
    train_side, got, rep, mode, report = sides.train, sides.config, sides.replay, sides.mode, sides.align
    L = source.cfg.num_hidden_layers
    check, refused = None, pp_refusal(request.pipeline, request.ids.server, source.cfg)
    served_ok = bool(rep.positions) and not got.off and rep.failure is None
    positions = rep.positions if served_ok else [p for p in train_side.positions if p is not None]
    notes = [] if served_ok or not positions else \
        [f"{serve.name} captures nothing from these ids; the check runs on the positions training used "
         f"({', '.join(map(str, positions))})"]
    if positions and refused is None:
        res = resolution(rep if served_ok else replay(serve, None, L), got.ids)
        res.positions = list(positions)
        if request.pipeline.size > 1:  # what reaches the draft under the engine's pipeline
            pp_replay(pipeline_for(request.pipeline, request.ids.server, source.cfg, list(request.tps), mode.mode),
                      request.ids.server, res, source.cfg)
        spec, _ = request.spec(source, tuple(res.positions), (mode.mode, mode.strategy))
        check = run_check(spec, res, list(request.tps))
        if check is None:
            return None
    t = Triage(inputs, mode, report, got, rep, check, notes=notes)
    if refused is not None:
        t.findings.append(refused)
        return t
    assess(t, inputs.target.real.hidden_size)
    return t


def assess(t: Triage, hidden: int) -> None:
    """Fill t.findings (in the order a user should fix them) and t.notes."""
    serve, rep, got = t.serve, t.replay, t.config
    if got.off:
        t.findings.append(Finding(Kind.CAPTURE_OFF, got.failure, [str(serve.behaviour.config.source)],
                                  "remove use_aux_hidden_state: false from eagle_config (an EAGLE-3 draft needs "
                                  "the aux hidden states)"))
        return
    t.findings += [_with_patch(t, f) if f.kind is Kind.ENGINE_FAILS and rep.crashed else f
                   for f in replay_findings(rep, hidden)]
    t.findings += _ids_changed(t)
    t.findings += _fallbacks(t)
    t.findings += _misaligned(t)
    t.findings += _served_mode(t)
    t.findings += [f for f in (t.check.resolution.findings if t.check is not None else []) if f.kind is Kind.PIPELINE]
    t.findings += _graphs(t)
    t.notes += unread_notes(t.serve, t.served)
    t.findings += served_flag_findings(t, t.served, t.serve)


def served_flag_findings(t: Triage, served: Served, serve: Profile) -> list[Finding]:
    """The findings of the served flags kept outside the model files (tpsim.app.served_flags) for `serve` launched
    as `served`."""
    hidden = t.inputs.target.real.hidden_size
    return [*algorithm_findings(serve, served, t.inputs.draft.raw),
            *fc_findings(serve, served, t.inputs.draft.raw, hidden, len(t.replay.slots)), *radix_findings(serve, served),
            *ubatch_findings(serve, served),
            *pd_findings(serve, served, hidden, t.inputs.draft.raw.get("hidden_size") or hidden, len(t.replay.slots))]


def _with_patch(t: Triage, f: Finding) -> Finding:
    """A crash on an embedding id, and what the same ids feed the draft on a server patched to run them."""
    if t.serve.patch is not None or "+embed" not in f.cause:
        return f
    rep = replay(patched(t.serve, Patch.EMBED.value, f"{t.serve.released}+embed"), t.config.ids, t.replay.num_layers)
    embed = [i for i, p in enumerate(rep.positions) if p.kind is PositionKind.EMBED]
    if not embed or any(p is not None and p.kind is PositionKind.EMBED for p in t.align.train.positions):
        return f
    return dataclasses.replace(f, cause=f"{f.cause}; patched, slot {embed[0]} feeds the draft the embedding output, "
                                        "which training never captured")


def config_reading(inputs: Inputs, caps: Captures) -> Triage:
    """What triage says of how the draft config's ids are read (ids changed, a key the server never reads), without
    running check: its findings, notes and warnings (acceptance prints them beside the AL)."""
    t = Triage(inputs, caps.mode, caps.align, caps.config, caps.replay, None)
    if not caps.config.off:
        t.findings += _ids_changed(t) + _fallbacks(t)
    return t


def _ids_changed(t: Triage) -> list[Finding]:
    """Training's ids, as the user gives them, against the ids the draft config holds now."""
    trained, draft = t.inputs.trained, t.inputs.draft
    written = draft.nested if draft.nested is not None else draft.top
    if trained.ids is None or written is None:
        return []
    L = t.replay.num_layers
    now = replay(trained.profile, written, L)
    then = [p for p in t.align.train.positions if p is not None]
    if now.failure is None and now.positions == then:
        return []
    if not t.config.off and t.replay.failure is None and list(t.replay.positions) == then:
        t.notes.append(f"the draft config's ids {written} are not the ids training used ({list(trained.ids)}), but "
                       f"{t.serve.name} captures the trained positions from them ({', '.join(map(str, then))}): "
                       "served as trained")
        return []
    reads = f"read in {trained.convention.value} numbering: {_pos(now)}" if now.failure is None else \
        f"which {trained.convention.value} numbering cannot read: {now.failure.split(' (')[0]}"
    key = "eagle_config.eagle_aux_hidden_state_layer_ids" if draft.nested is not None else \
        "eagle_aux_hidden_state_layer_ids"
    return [Finding(Kind.IDS_CHANGED,
                    f"the draft config holds ids {written} at {key} ({reads}); training captured "
                    f"{', '.join(map(str, then))} (--train {trained.spelled}): the config's ids were changed after "
                    "training, and the server reads the changed ones", [str(trained.profile.behaviour.numbering.source)],
                    "write the ids the server needs for the trained positions")]


def _fallbacks(t: Triage) -> list[Finding]:
    """The server ignores ids the config holds at a key it does not read, and what that changes."""
    got, ignored = t.config, t.config.ignored
    if got.fallback is None:
        return []
    meant = replay(t.train, ignored, t.replay.num_layers)  # what those ids capture read as the trainer reads them
    if t.inputs.trained.ids is not None and t.replay.failure is None and \
            list(t.replay.positions) == [p for p in t.align.train.positions if p is not None]:
        meant = t.replay  # training's ids given: the default lands on them, whatever the ignored ids say
    if meant.failure or meant.positions == t.replay.positions:
        safeguard = _fix_ids(t, meant, ignored) if not meant.failure else None
        t.warnings.append(f"{got.fallback}; its default captures what those ids would, so this works by coincidence"
                          " (another engine version or layer count breaks it)" +
                          (f"; safeguard: {safeguard}" if safeguard else ""))
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
    real, n = t.inputs.target.real, len(t.check.spec.positions)
    width = "" if t.inputs.target.standin is None else \
        f" (at the real widths: each captured state is {real.hidden_size} wide, {n} x {real.hidden_size} = " \
        f"{n * real.hidden_size} per token into the draft's fc, each rank's 1/{t.served.tp} shard " \
        f"{real.hidden_size // t.served.tp} wide)"
    return [Finding(Kind.SERVED_MODE,
                    f"{'; '.join(t.mode.why)}; replayed as mode {t.mode.mode.name}, capture strategy "
                    f"{t.mode.strategy}: {fails}{width}", [str(c.source) for c in t.mode.decided_by], fix)]


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
    return f"{q.name.split(':')[0]} or later" + (f" ({q.versions.since.label})" if q.versions.since.prs else "")


def _pos(rep: Replay) -> str:
    return ", ".join(map(str, rep.positions)) or "nothing"
