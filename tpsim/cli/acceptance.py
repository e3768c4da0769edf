"""`tpsim acceptance`: the acceptance length a capture costs, measured: the draft on the capture it was trained
on and on the capture the engine serves, over the target's greedy answers (tpsim.app.acceptance).

Exit 0 the served capture keeps the trained AL (within two standard errors), 1 it does not, the engine never
feeds the draft, or no verify round was left to measure (no verdict), 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import sys

from tpsim.app.acceptance import AcceptanceReport, Measured
from tpsim.app.acceptance_request import AcceptanceRequest, AcceptanceResult, run_acceptance
from tpsim.app.triage import Triage
from tpsim.app.asks import draft_path
from tpsim.app.block_draft import block_config
from tpsim.base.errors import UsageError
from tpsim.cli.block_draft import refuse_acceptance
from tpsim.base.ui import say
from tpsim.cli.options import emit_json, int_list, positive_int
from tpsim.cli.run_args import request_from, served_tp
from tpsim.cli.served import engine_ask, prompts_ask
from tpsim.cli.sweep import cmd_sweep
from tpsim.profiles.vllm import assumed


def request(args) -> AcceptanceRequest:
    """argv as the typed request (one served configuration: --server given once)."""
    if not args.server:
        raise UsageError("acceptance needs --server PROFILE, the engine as served, e.g. --server sglang@0.5.12 "
                         "(tpsim profiles lists them)")
    server = args.server[0] if isinstance(args.server, list) else args.server
    tp = served_tp(args)
    ids = None if args.draft_ids is None else tuple(int_list(args.draft_ids, "--draft-ids"))
    return AcceptanceRequest(server, engine_ask(args, tp, server), args.draft, args.model,
                             tuple(args.override or ()), positive_int(args.steps, "--steps"), prompts_ask(args),
                             args.returned_hidden_states, args.force, request_from(args, [tp]), ids)


def cmd_acceptance(args) -> int:
    if args.sweep is not None or len(args.server or ()) > 1:
        return cmd_sweep(args, request)
    block = block_config(args.draft and str(draft_path(args.draft)))
    if block is not None:
        refuse_acceptance(args.draft, block[0])
    req = request(args)
    r = run_acceptance(req)
    if r is None:  # a torchrun rank other than 0
        return 0
    if args.json:
        emit_json({**to_dict(r, req), "unverified": r.stale and r.stale.to_dict()})
    elif args.summary:
        print(f"tpsim acceptance: {verdict(r.report, r.reading)}")
    else:
        print_report(r, req)
        if r.stale:
            say(r.stale.line)
    if r.written:  # on stderr with --json or --summary, whose stdout is the report alone
        line = (f"wrote {len(r.written)} files, {r.written[0].name} .. {r.written[-1].name}: the hidden states "
                f"{r.returned.server} returns ({r.returned.value.value}; tpsim diagnose FILE --reference ... reads one)")
        print(line, file=sys.stderr) if args.json or args.summary else say(line)
    return 0 if r.ok else 1


def to_dict(result: AcceptanceResult, req: AcceptanceRequest) -> dict:
    r, reading = result.report, result.reading
    return {"kept": r.kept, "draft": req.draft, "server": r.inputs.served.server, "serve_profile": r.inputs.serve.name,
            "assumed": assumed(r.inputs.serve),
            "assumptions": req.engine.assumptions(r.inputs.serve, result.server, r.inputs.target.real.model_type),
            "train": r.inputs.trained.name, "model": r.inputs.target.name, "tp": r.inputs.served.tp, "steps": r.k,
            "prompts": result.origin, "sequences": len(r.sequences),
            "answer_tokens": sum(s.answer for s in r.sequences),
            "trained": r.trained.to_dict(), "served": r.served.to_dict(),
            "difference": None if r.difference is None else round(r.difference, 4),
            "noise": None if r.noise is None else round(r.noise, 4),
            "paired": None if r.paired is None else {"difference": round(r.paired[0], 4),
                                                      "stderr": round(r.paired[1], 4),
                                                      "positions": sum(len(x) for x in r.trained.acceptance.rows)},
            "notes": r.notes + reading.notes, "warnings": reading.warnings,
            "config_findings": [f.to_dict() for f in reading.findings]}


def _line(m: Measured) -> str:
    a = m.acceptance
    if a is None:
        return f"  {m.fed.label:8} {m.fed.text}: not measured: {m.fed.failure}"
    per = " ".join(f"{x:.2f}" for x in a.per_position)
    split = "" if m.ranks_identical else " (the ranks' captures differ: rank 0's fed the draft)"
    return f"  {m.fed.label:8} AL {a.length:.2f} ± {a.stderr:.2f}  per position {per}  ({a.rounds} rounds)  " \
           f"{m.fed.text}{split}"


def print_report(result: AcceptanceResult, req: AcceptanceRequest) -> None:
    r, reading, t = result.report, result.reading, result.report.inputs.target
    say(f"tpsim acceptance: draft {req.draft} on {t.name} ({t.real.num_hidden_layers} layers, hidden_size "
        f"{t.real.hidden_size}), trained by {r.inputs.trained.name}, served by {r.inputs.served.server} at TP {r.inputs.served.tp}")
    for a in req.engine.assumptions(r.inputs.serve, result.server, t.real.model_type):
        say(f"assumed: {a}")
    say(f"prompts: {result.origin}: {len(r.sequences)} sequences, {sum(s.answer for s in r.sequences)} answer tokens; "
        f"greedy chain drafting, k = {r.k} draft tokens per verify round")
    say(f"served mode: {r.captures.mode.mode.name}, capture strategy {r.captures.mode.strategy} "
        f"({'; '.join(r.captures.mode.why)})")
    for n in r.notes + reading.notes:
        say(f"note: {n}")
    for w in reading.warnings:
        say(f"WARNING: {w}")
    for f in reading.findings:
        say(f"config: {f.kind.value}: {f.cause} (tpsim triage replays its fix)")
    say(_line(r.trained))
    say(_line(r.served))
    if r.paired is not None:
        mean, se = r.paired
        n = sum(len(x) for x in r.trained.acceptance.rows)
        say(f"paired over the same {n} answer positions: served - trained = {mean:+.3f} tokens accepted per round "
            f"(standard error {se:.3f} over the {len(r.sequences)} sequences)")
    say(f"VERDICT: {verdict(r, reading)}")


def verdict(r: AcceptanceReport, reading: Triage) -> str:
    if r.trained.acceptance is None:  # nothing to compare the served capture with: no judgement either way
        return f"no verdict: {r.trained.fed.failure}"
    if r.paired is None:
        return "the engine never feeds the draft this capture (see above)"
    mean, se = r.paired
    if r.kept and reading.findings:
        return (f"the served capture keeps the acceptance measured (AL {r.difference:+.2f}), but the server reads "
                f"the config's ids otherwise than training did ({len(reading.findings)} config finding"
                f"{'s' * (len(reading.findings) > 1)}: {', '.join(f.kind.value for f in reading.findings)}): tpsim "
                "triage with the same flags names the fix")
    if r.kept:
        return f"the served capture keeps the trained acceptance (AL {r.difference:+.2f})"
    return (f"the served capture costs {-mean:.3f} tokens per verify round, {-mean / se:.0f} standard errors "
            f"(AL {r.trained.acceptance.length:.2f} -> {r.served.acceptance.length:.2f}); tpsim triage with the same "
            "flags names the cause and the fix")
