"""`tpsim diagnose`: what did each rank of a TP group actually capture? (tpsim.offline.diagnosis
infers it; tpsim.offline.dumps reads the rank files, tpsim.offline.reference the reference; this module
takes the options and prints.)"""

from __future__ import annotations

from tpsim.profiles.conventions import Convention, check_convention
from tpsim.offline.diagnosis import SIMILARITY, THRESHOLDS, DiagnoseReport, diagnose_files, shapes_text
from tpsim.cli.options import emit_json, int_list, optional_int
from tpsim.base.errors import UsageError
from tpsim.offline.dumps import DumpKind
from tpsim.offline.reference import parse_positions
from tpsim.base.ui import say, table


def cmd_diagnose(args) -> int:
    positions = parse_positions(args.positions) if args.positions else None
    layer_ids = None if args.layer_ids is None else int_list(args.layer_ids, "--layer-ids")
    if args.num_layers is not None and layer_ids is None:
        raise UsageError("--num-layers checks --layer-ids, which is not given; add --layer-ids or drop --num-layers")
    if args.convention is not None:  # kept as written (output-of stays output-of in the report)
        check_convention(args.convention, "--convention")
    if args.convention is not None and layer_ids is None:
        raise UsageError("--convention numbers --layer-ids, which is not given; add --layer-ids or drop --convention")
    convention = args.convention or Convention.VLLM.value
    report = diagnose_files(args.files, args.reference, args.point, positions,
                            optional_int(args.hidden_size, "--hidden-size", 1), optional_int(args.step, "--step", 0),
                            layer_ids, optional_int(args.num_layers, "--num-layers", 1), convention)
    if args.json:
        emit_json(report.to_dict())
    else:
        print_report(report)
    return 0 if report.ok else 1


def print_report(rep: DiagnoseReport) -> None:
    toks = "" if rep.tokens is None else f", {rep.tokens} tokens"
    gathered = isinstance(rep.kind, DumpKind) and rep.kind.gathered
    if gathered:
        say(f"tpsim diagnose: {len(rep.files)} file ({rep.kind}: gathered, one copy for every TP rank{toks})")
    else:
        say(f"tpsim diagnose: {len(rep.files)} rank files ({rep.kind}, tp={rep.tp}{toks})")
    ref = rep.reference
    say(f"reference: {ref['path']} ({ref['kind']}): {', '.join(ref['candidates'])}")
    say(f"similarity: {SIMILARITY}; a match needs <= {THRESHOLDS['exact']:.0e} (float32/float64 on both "
        f"sides) or <= {THRESHOLDS['low_precision']:.0e} (bfloat16/float16 on either side)")
    for n in rep.notes:
        say(f"note: {n}")
    rows = [[r.point, shapes_text(r.shapes),  # "[8, 64] x2": the shape and how many ranks hold it
             r.placement + (f" (declared {r.declared})" if r.declared_agrees is False else ""),
             "itself" if r.matches == r.point else r.matches or "-", "-" if r.diff is None else f"{r.diff:.2e}",
             "yes" if r.correct else "NO", r.reason] for r in rep.points]
    table(["point", "shape per rank", "placement", "matches", "diff", "ok", "reason"], rows,
          notes=("reason", "matches"), whole=("placement", "diff"))
    bad = [r.point for r in rep.points if not r.correct]
    if not bad and gathered:
        say("PASS: every slot of the gathered copy is the asked tensor")
    elif not bad:
        say(f"PASS: every point is Replicate() and the asked tensor on all {rep.tp} ranks")
    else:
        say(f"FAIL: {len(bad)} of {len(rep.points)} points are not Replicate() of the asked tensor: "
            f"{', '.join(bad)}")
