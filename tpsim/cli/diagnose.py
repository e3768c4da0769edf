"""`tpsim diagnose`: what did each rank of a TP group actually capture? (tpsim.capture.diagnosis
infers it; tpsim.files.dumps reads the files; this module takes the options and prints.)"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from tpsim.capture.diagnosis import SIMILARITY, THRESHOLDS, DiagnoseReport, diagnose_files, shapes_text
from tpsim.cli.options import add_json, emit_json, optional_int
from tpsim.files.dumps import parse_positions
from tpsim.ui import stdout, table


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="infer what each rank captured (replicated, partial sums, token/hidden "
                                        "shards, the wrong layer) against a reference")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="one run's per-rank files: tpsim rank dumps ({stem}.rank{r}.safetensors) or SGLang "
                        "dumper .pt files (or a directory of them)")
    p.add_argument("--reference", required=True,
                   help="a tpsim capture file, a TP=1 rank dump, or training features (.pt/.safetensors)")
    p.add_argument("--point", action="append", help="diagnose only this point (repeatable; default: every point "
                                                    "present on every rank)")
    p.add_argument("--positions", help="names of the reference's slots, e.g. embed,out(1),out(3)")
    p.add_argument("--hidden-size", help="split the reference's slots by this width")
    p.add_argument("--step", help="SGLang dumps: the step (forward pass) to diagnose")
    add_json(p, cmd_diagnose)


def cmd_diagnose(args) -> int:
    positions = parse_positions(args.positions) if args.positions else None
    report = diagnose_files(args.files, args.reference, args.point, positions,
                            optional_int(args.hidden_size, "--hidden-size", 1), optional_int(args.step, "--step", 0))
    if args.json:
        emit_json(report.to_dict())
    else:
        print_report(report)
    return 0 if report.ok else 1


def print_report(rep: DiagnoseReport) -> None:
    out = stdout if stdout.is_terminal else Console(highlight=False, width=1000)  # a pipe: one line per row
    say = lambda text: out.print(escape(text))  # noqa: E731  (names like x[layer_id=3] are not markup)
    toks = "" if rep.tokens is None else f", {rep.tokens} tokens"
    say(f"tpsim diagnose: {len(rep.files)} rank files ({rep.kind}, tp={rep.tp}{toks})")
    ref = rep.reference
    say(f"reference: {ref['path']} ({ref['kind']}): {', '.join(ref['candidates'])}")
    say(f"similarity: {SIMILARITY}; a match needs <= {THRESHOLDS['exact']:.0e} (float32/float64 on both "
        f"sides) or <= {THRESHOLDS['low_precision']:.0e} (bfloat16/float16 on either side)")
    for n in rep.notes:
        say(f"note: {n}")
    show_declared = any(r.declared for r in rep.points)
    cols = ["point", "ranks", "shape per rank", "placement", *(["declared"] if show_declared else []),
            "matches", "diff", "correct", "reason"]
    rows = []
    for r in rep.points:
        decl = [] if not show_declared else [
            "-" if r.declared is None else r.declared + (" (disagrees)" if r.declared_agrees is False else "")]
        rows.append([escape(c) for c in (
            r.point, str(r.ranks), shapes_text(r.shapes), r.placement, *decl, r.matches or "-",
            "-" if r.diff is None else f"{r.diff:.2e}", "yes" if r.correct else "NO", r.reason)])
    out.print(table("", cols, rows))
    bad = [r.point for r in rep.points if not r.correct]
    if not bad:
        say(f"PASS: every point is Replicate() and the asked tensor on all {rep.tp} ranks")
    else:
        say(f"FAIL: {len(bad)} of {len(rep.points)} points are not Replicate() of the asked tensor: "
            f"{', '.join(bad)}")
