"""`tpsim triage`: "my draft's acceptance dropped after a TP or engine change": read the draft
config as the trainer and the server each read it, align the two captures, work out the mode the
served flags and the engine's auto-enable rules put it in, run `check` in that mode on the target's
shape, and print one verdict.

Exit 0 nothing found, 1 findings, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

from tpsim.app.acceptance import Measured
from tpsim.app.asks import draft_path
from tpsim.app.draft_mtp import mtp_config
from tpsim.app.remedies import Plan
from tpsim.app.triage import Triage
from tpsim.app.triage_request import TriageRequest, TriageResult, run_triage
from tpsim.app.block_draft import block_config
from tpsim.base.errors import UsageError
from tpsim.cli.block_draft import run_block
from tpsim.base.ui import say
from tpsim.cli.draft_mtp import cmd_mtp
from tpsim.cli.findings import say_finding
from tpsim.cli.options import emit_json, positive_int
from tpsim.cli.run_args import one_tp, request_from
from tpsim.cli.served import engine_ask, prompts_ask
from tpsim.draft.findings import DraftFinding
from tpsim.profiles.vllm import assumed


def request(args) -> TriageRequest:
    """argv as the typed request."""
    if args.server is None:
        raise UsageError("triage needs --server PROFILE, the engine as served, e.g. --server sglang@0.5.12 "
                         "(tpsim profiles lists them)")
    tp = one_tp(args)
    return TriageRequest(args.server, engine_ask(args, tp, args.server),
                         None if args.draft is None else str(draft_path(args.draft)), args.draft_config, args.model,
                         tuple(args.override or ()), args.measure, positive_int(args.steps, "--steps"),
                         prompts_ask(args), request_from(args, [tp]))


def cmd_triage(args) -> int:
    head = args.draft or args.draft_config
    if head and (raw := mtp_config(draft_path(head))) is not None:  # an MTP head: what it is fed (docs/mtp.md)
        return cmd_mtp(draft_path(head), raw, [args.server] if args.server else [], args.json, args.summary,
                       "triage")
    block = block_config(args.draft_config or args.draft)
    if block is not None and args.server is not None:  # a DFlash or DSpark draft (tpsim.cli.block_draft)
        return run_block(args, *block, "triage")
    req = request(args)
    r = run_triage(req)
    if r is None:  # a torchrun rank other than 0
        return 0
    if args.json:
        emit_json({**to_dict(r, req), "plan": r.plan and r.plan.to_dict(), "unverified": r.stale and r.stale.to_dict()})
    elif args.summary:
        print(summary(r.t, r.checkpoint, r.plan))
    else:
        print_triage(r, req)
        if r.stale:
            say(r.stale.line)
    return 0 if r.ok else 1


def to_dict(r: TriageResult, req: TriageRequest) -> dict:
    t, checkpoint, measured, target = r.t, r.checkpoint, r.measured, r.t.inputs.target
    return {"ok": r.ok, "server": t.served.server, "serve_profile": t.serve.name, "assumed": assumed(t.serve),
            "assumptions": req.engine.assumptions(t.serve, r.server, target.real.model_type),
            "train": t.inputs.trained.name,
            "train_ids": t.inputs.trained.ids and list(t.inputs.trained.ids),
            "target": {"model": target.name, "chosen": target.chosen, "hidden_size": target.real.hidden_size,
                       "num_hidden_layers": target.real.num_hidden_layers,
                       "stand_in": target.standin and target.standin.shrunk},
            "tp": t.served.tp, "gpu": t.served.gpu.value, "model": target.name, "num_layers": t.replay.num_layers,
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


def print_triage(r: TriageResult, req: TriageRequest) -> None:
    t, checkpoint, measured, best = r.t, r.checkpoint, r.measured, r.plan
    s, target = t.served, t.inputs.target
    say(f"tpsim triage: {req.config_path} served by {s.server} at TP={s.tp} on {s.gpu.value}, trained by "
        f"{t.inputs.trained.name}; target {target.name} ({t.replay.num_layers} layers, hidden_size "
        f"{target.real.hidden_size}{': ' + target.chosen if target.chosen else ''})")
    say(f"{s.server} runs the code of profile {t.serve.name} ({t.serve.versions.text()})")
    for a in req.engine.assumptions(t.serve, r.server, target.real.model_type):
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
        say(f"measured (greedy chain drafting, k = {req.steps}, {measured.sequences} sequences): AL "
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
        say(f"not checked: {unchecked(t, req)}")


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


def unchecked(t: Triage, req: TriageRequest) -> str:
    """What a clean triage did not look at, and the command that does."""
    draft = f"the draft's weights (embed_tokens, d2t, fc, the vocabulary over TP): tpsim draft DIR --server " \
            f"{t.served.server} --model {t.inputs.target.name} --tp {t.served.tp}, or triage --draft DIR" \
        if req.draft is None else ""
    al = "" if req.measure else "the acceptance it costs: triage --draft DIR --measure, where the target runs here"
    engine = "the engine itself: tpsim observe (vLLM runs here)" if t.serve.engine == "vllm" else \
        "the engine itself (SGLang does not run on a CPU: its behaviour is read from its released code)"
    return "; ".join(x for x in (draft, al, engine) if x)
