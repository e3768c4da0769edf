"""`tpsim acceptance`: the acceptance length a capture costs, measured: the draft on the capture it was trained
on and on the capture the engine serves, over the target's greedy answers (tpsim.app.acceptance).

Exit 0 the served capture keeps the trained AL (within two standard errors), 1 it does not or the engine never
feeds the draft, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tpsim.app.acceptance import AcceptanceReport, Measured, measure
from tpsim.app.preflight import check_divides_world, check_timeout
from tpsim.app.returned import returned_paths, write_returned
from tpsim.app.target import target_for
from tpsim.app.triage import Inputs, Triage, config_reading
from tpsim.base.errors import UsageError
from tpsim.base.ui import say
from tpsim.cli.options import emit_json, positive_int
from tpsim.cli.outputs import check_output
from tpsim.cli.run_args import request_from, served_tp
from tpsim.cli.served import assumptions, draft_dir, engines_from, prompts_from
from tpsim.draft.checkpoint import read
from tpsim.offline.align import read_draft_config
from tpsim.parallel.torchrun import under_torchrun
from tpsim.profiles.fingerprints import unverified
from tpsim.profiles.history import model_file_server
from tpsim.profiles.returned import RETURNED
from tpsim.profiles.vllm import assumed


def cmd_acceptance(args) -> int:
    if args.server is None:
        raise UsageError("acceptance needs --server PROFILE, the engine as served, e.g. --server sglang@0.5.12 "
                         "(tpsim profiles lists them)")
    check_timeout(args.timeout)
    returned = None if args.returned_hidden_states is None else RETURNED.at(args.server)
    given = args.server  # an SGLang version before the model files read: its capture is the oldest read one's
    args.server, replayed_as = model_file_server(given, "the radix cache")
    k = positive_int(args.steps, "--steps")
    tp = served_tp(args)
    path = draft_dir(args.draft)
    ckpt = read(path)
    config = read_draft_config(str(path))
    target = target_for(config, args.model, args.override or [], tp, args.device)
    if target.standin is not None:
        raise UsageError(f"--model {target.name} is too big to run here and a stand-in's answers say nothing about "
                         "acceptance; give a target that runs here (e.g. --model smollm2-135m), or run on a GPU (--device cuda)")
    args.model = target.name
    serve, trained, served = engines_from(args, target.real, tp, given)
    prompts = prompts_from(args, target)
    check_returned(args, len(prompts.sequences) + len(prompts.to_answer))
    report = measure(Inputs(trained, serve, served, config, request_from(args, sorted({1, tp})), target),
                     ckpt, k, prompts)
    if report is None:  # a torchrun rank other than 0
        return 0
    report.notes[:0] = [replayed_as] if replayed_as else []
    stale = unverified(args.server, target.real.model_type)
    written = [] if returned is None else write_returned(report, returned, Path(args.returned_hidden_states))
    reading = config_reading(report.inputs, report.captures)
    if args.json:
        emit_json({**to_dict(report, reading, args, prompts.origin), "unverified": stale and stale.to_dict()})
    elif args.summary:
        print(f"tpsim acceptance: {verdict(report, reading)}")
    else:
        print_report(report, reading, args, prompts.origin)
        if stale:
            say(stale.line)
    if written:  # on stderr with --json or --summary, whose stdout is the report alone
        line = (f"wrote {len(written)} files, {written[0].name} .. {written[-1].name}: the hidden states "
                f"{returned.server} returns ({returned.value.value}; tpsim diagnose FILE --reference ... reads one)")
        print(line, file=sys.stderr) if args.json or args.summary else say(line)
    return 0 if report.kept and not reading.findings else 1


def check_returned(args, sequences: int) -> None:
    """--returned-hidden-states: the files it writes, checked before anything runs."""
    if args.returned_hidden_states is not None:
        for path in returned_paths(Path(args.returned_hidden_states), sequences):
            check_output(path, "--returned-hidden-states", "x.safetensors", args.force)


def to_dict(r: AcceptanceReport, reading: Triage, args, origin: str) -> dict:
    return {"kept": r.kept, "draft": args.draft, "server": r.inputs.served.server, "serve_profile": r.inputs.serve.name,
            "assumed": assumed(r.inputs.serve),
            "assumptions": assumptions(r.inputs.serve, args.server, args.train, r.inputs.target.real.model_type),
            "train": r.inputs.trained.name, "model": r.inputs.target.name, "tp": r.inputs.served.tp, "steps": r.k,
            "prompts": origin, "sequences": len(r.sequences),
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


def print_report(r: AcceptanceReport, reading: Triage, args, origin: str) -> None:
    t = r.inputs.target
    say(f"tpsim acceptance: draft {args.draft} on {t.name} ({t.real.num_hidden_layers} layers, hidden_size "
        f"{t.real.hidden_size}), trained by {r.inputs.trained.name}, served by {r.inputs.served.server} at TP {r.inputs.served.tp}")
    for a in assumptions(r.inputs.serve, args.server, args.train, t.real.model_type):
        say(f"assumed: {a}")
    say(f"prompts: {origin}: {len(r.sequences)} sequences, {sum(s.answer for s in r.sequences)} answer tokens; "
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
