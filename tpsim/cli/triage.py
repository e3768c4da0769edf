"""`tpsim triage`: "my draft's acceptance dropped after a TP or engine change": read the draft
config as the trainer and the server each read it, align the two captures, work out the mode the
served flags and the engine's auto-enable rules put it in, run `check` in that mode on the target's
shape, and print one verdict.

Exit 0 nothing found, 1 findings, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

from tpsim.offline.align import read_draft_config
from tpsim.app.acceptance import Measured, TriageMeasure, measure_triage
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json, positive_int
from tpsim.draft.checkpoint import inspect, read
from tpsim.draft.findings import DraftFinding
from tpsim.app.draft_served import served_findings, target_embedding
from tpsim.profiles.loader_lines import lookup
from tpsim.cli.run_args import one_tp, request_from
from tpsim.profiles.vllm import assumed
from tpsim.cli.served import assumptions, draft_dir, engines_from, prompts_from
from tpsim.base.errors import UsageError
from tpsim.profiles.fingerprints import unverified
from tpsim.app.preflight import check_divides_world, check_timeout
from tpsim.app.remedies import Plan, plan, replay_fixes
from tpsim.app.target import target_for
from tpsim.app.triage import Inputs, Triage, triage
from tpsim.base.ui import say, step
from tpsim.profiles.history import model_file_server


def cmd_triage(args) -> int:
    if args.server is None:
        raise UsageError("triage needs --server PROFILE, the engine as served, e.g. --server sglang@0.5.12 "
                         "(tpsim profiles lists them)")
    check_timeout(args.timeout)
    given = args.server  # an SGLang version before the model files read: its capture is the oldest read one's
    args.server, replayed_as = model_file_server(given, "the radix cache and the PD hand-off")
    tp = one_tp(args)
    check_divides_world(tp)
    tps = sorted({1, tp})
    if args.measure and args.draft is None:
        raise UsageError("--measure runs the draft: give its checkpoint directory with --draft DIR instead of "
                         "--draft-config")
    path = args.draft_config if args.draft is None else str(draft_dir(args.draft))
    args.draft_config = path  # what the header names and the request's ids read
    ckpt = None if args.draft is None else read(path)
    draft = read_draft_config(path)
    target = target_for(draft, args.model, args.override or [], tp)
    if args.measure and target.standin is not None:
        raise UsageError(f"--measure runs the target, and {target.name} is too big to run here (triage replays it on "
                         "a stand-in, whose answers say nothing about acceptance); drop --measure, or give a target "
                         "that runs here with --model")
    args.model = target.name
    cfg = target.real
    serve_p, trained, served = engines_from(args, cfg, tp, given)
    prompts = prompts_from(args, target) if args.measure else None
    k = positive_int(args.steps, "--steps")
    with step(f"triage: check at TP {', '.join(map(str, tps))}"):
        t = triage(Inputs(trained, serve_p, served, draft, request_from(args, tps), target))
    if t is None:  # a torchrun rank other than 0
        return 0
    t.notes[:0] = [replayed_as] if replayed_as else []
    tried: dict = {}
    replay_fixes(t, tried)
    best = plan(t, tried)
    checkpoint = [] if ckpt is None else served_findings(
        ckpt, inspect(ckpt, cfg.hidden_size), [lookup(args.server.partition("+")[0])],
        target_embedding(target.source) if target.standin is None else None, served.tp)
    measured = None if not args.measure else measure_triage(t, ckpt, k, prompts)
    if args.measure and measured is None:
        return 0
    stale = unverified(args.server, cfg.model_type)
    if args.json:
        emit_json({**to_dict(t, args, checkpoint, measured), "plan": best and best.to_dict(),
                   "unverified": stale and stale.to_dict()})
    elif args.summary:
        print(summary(t, checkpoint, best))
    else:
        print_triage(t, args, checkpoint, measured, best)
        if stale:
            say(stale.line)
    return 0 if t.ok and not checkpoint else 1


def to_dict(t: Triage, args, checkpoint: list[DraftFinding], measured: TriageMeasure | None) -> dict:
    target = t.inputs.target
    return {"ok": t.ok and not checkpoint, "server": t.served.server, "serve_profile": t.serve.name, "assumed": assumed(t.serve),
            "assumptions": assumptions(t.serve, args.server, args.train, target.real.model_type),
            "train": t.inputs.trained.name,
            "train_ids": t.inputs.trained.ids and list(t.inputs.trained.ids),
            "target": {"model": target.name, "chosen": target.chosen, "hidden_size": target.real.hidden_size,
                       "num_hidden_layers": target.real.num_hidden_layers,
                       "stand_in": target.standin and target.standin.shrunk},
            "tp": t.served.tp, "gpu": t.served.gpu.value, "model": args.model, "num_layers": t.replay.num_layers,
            "served_mode": {"mode": t.mode.mode.to_dict(), "capture_strategy": t.mode.strategy.value, "why": t.mode.why},
            "align": t.align.to_dict(), "check": None if t.check is None else t.check.to_dict(),
            "warnings": t.warnings, "findings": [{**f.to_dict(), "change": t.fixes[i].to_dict() if i in t.fixes else None,
                          "left_by_fix_alone": t.left.get(i),
                          "measured_with_fix": measured.fixed[i].to_dict() if measured and i in measured.fixed else None}
                         for i, f in enumerate(t.findings)], "notes": t.notes,
            "draft_findings": [f.to_dict() for f in checkpoint],
            "measured": measured and {"trained": measured.trained.to_dict(), "served": measured.served.to_dict(),
                                      "sequences": measured.sequences, "notes": measured.notes}}


def _al(m: Measured, why: bool = False) -> str:
    if m.acceptance is None:
        return f"not measured ({m.fed.failure})" if why else "not measured"
    return f"{m.acceptance.length:.2f}"


def print_triage(t: Triage, args, checkpoint: list[DraftFinding], measured: TriageMeasure | None,
                 best: Plan | None) -> None:
    s, target = t.served, t.inputs.target
    say(f"tpsim triage: {args.draft_config} served by {s.server} at TP={s.tp} on {s.gpu.value}, trained by "
        f"{t.inputs.trained.name}; target {target.name} ({t.replay.num_layers} layers, hidden_size "
        f"{target.real.hidden_size}{': ' + target.chosen if target.chosen else ''})")
    say(f"{s.server} runs the code of profile {t.serve.name} ({t.serve.versions.text()})")
    for a in assumptions(t.serve, args.server, args.train, target.real.model_type):
        say(f"assumed: {a}")
    if target.standin is not None:
        say(target.standin.line(target.name, s.tp))
    say(f"served mode: {t.mode.mode.name}, capture strategy {t.mode.strategy} ({'; '.join(t.mode.why)})")
    say(f"train captures {', '.join(map(str, (p for p in t.align.train.positions if p))) or 'nothing'}; "
        f"serve captures {', '.join(map(str, t.replay.positions)) or 'nothing'}")
    if t.check is not None:
        held = all(r.ok for r in t.check.rows)
        say(f"check in mode {t.mode.mode.name} at TP {', '.join(str(r.tp) for r in t.check.rows)} on "
            f"{len(t.check.spec.tokens)} tokens: {'the capture holds' if held else 'the capture breaks'}")
    for n in t.notes + (measured.notes if measured else []):
        say(f"note: {n}")
    if measured is not None:
        say(f"measured (greedy chain drafting, k = {args.steps}, {measured.sequences} sequences): AL "
            f"{_al(measured.trained, True)} as trained, {_al(measured.served, True)} as served")
    for i, f in enumerate(t.findings, 1):
        say_finding(i, f.kind.value, f.cause, f.sources, f.fix)
        if f.replayed:
            left = t.left.get(i - 1, 0)
            say("  fix replayed: the finding clears, and no other appears" +
                (f"; alone it leaves {left} other{'s' * (left > 1)}: partial (the PLAN below does all)" if left else ""))
        if measured is not None and i - 1 in measured.fixed:
            say(f"  measured: AL {_al(measured.trained)} as trained, {_al(measured.served)} as served, "
                f"{_al(measured.fixed[i - 1])} with the fix")
    for j, f in enumerate(checkpoint, len(t.findings) + 1):
        say_finding(j, f"draft checkpoint: {f.title}", f.cause, [f.source], f.fix)
    if best is not None:
        left = "nothing found" if best.clears else \
            f"{len(best.remaining)} remain: {'; '.join(f.kind.value for f in best.remaining)}"
        say(f"PLAN, every change together{'' if best.clears else ' (the best tpsim found)'}: {best.change.text}")
        say(f"  plan replayed as a whole: {left}")
    for w in t.warnings:
        say(f"WARNING: {w}")
    n = len(t.findings) + len(checkpoint)
    say()
    say("VERDICT: nothing found" if n == 0 else f"VERDICT: {n} finding{'s' * (n > 1)}")
    if n == 0:
        say(f"not checked: {unchecked(t, args)}")


def summary(t: Triage, checkpoint: list[DraftFinding], best: Plan | None) -> str:
    """One line for a CI log: the verdict, each finding's kind, the PLAN and its replay's verdict."""
    kinds = [f.kind.value for f in t.findings] + [f"draft checkpoint: {f.defect.value}" for f in checkpoint]
    if not kinds:
        return "tpsim triage: VERDICT: nothing found" + "".join(f"; WARNING: {w}" for w in t.warnings[:1])
    line = f"tpsim triage: VERDICT: {len(kinds)} finding{'s' * (len(kinds) > 1)} ({'; '.join(kinds)})"
    if best is None:
        return line + "; no PLAN: no replayed change clears them"
    return line + f"; PLAN: {best.change.text}; plan replayed as a whole: " + \
        ("nothing found" if best.clears else f"{len(best.remaining)} remain")


def unchecked(t: Triage, args) -> str:
    """What a clean triage did not look at, and the command that does."""
    draft = f"the draft's weights (embed_tokens, d2t, fc, the vocabulary over TP): tpsim draft DIR --server " \
            f"{t.served.server} --model {args.model} --tp {t.served.tp}, or triage --draft DIR" \
        if args.draft is None else ""
    al = "" if args.measure else "the acceptance it costs: triage --draft DIR --measure, where the target runs here"
    engine = "the engine itself: tpsim observe (vLLM runs here)" if t.serve.engine == "vllm" else \
        "the engine itself (SGLang does not run on a CPU: its behaviour is read from its released code)"
    return "; ".join(x for x in (draft, al, engine) if x)
