"""`tpsim align`: does the trainer of an EAGLE-3 draft capture the same residual-stream positions,
in the same slot order, as the server that runs it? (tpsim.offline.align compares; this module
reads the options, runs the model when --model is given, and prints.)

Exit 0 aligned, 1 not aligned, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

from tpsim.app.align_request import AlignRequest, AlignResult, run_align
from tpsim.app.block_draft import block_config
from tpsim.base.errors import UsageError
from tpsim.cli.block_draft import run_block
from tpsim.base.ui import say, table
from tpsim.cli.options import EXECUTION_OPTIONS, emit_json, positive_int
from tpsim.cli.parser import refuse_without
from tpsim.cli.run_args import one_tp, request_from
from tpsim.offline.align import LABELS, Slot, positions_text
from tpsim.profiles.conventions import named_ids


def request(args) -> AlignRequest:
    """argv as the typed request."""
    refuse_without(args, "--model", args.model is not None, {"tp": "--tp", **EXECUTION_OPTIONS})
    if args.trainer is not None and args.serve is not None:  # --trainer reads a draft config: the other style
        raise UsageError("give either --train/--serve or --draft-config/--trainer/--server, not both")
    if args.trainer is not None and args.train is not None:
        raise UsageError("--trainer is the old name of --train; give one of them")
    return AlignRequest(args.train or args.trainer, args.serve, args.draft_config, args.server,
                        None if args.num_layers is None else positive_int(args.num_layers, "--num-layers"),
                        args.model, tuple(args.override or ()), 1 if args.model is None else one_tp(args),
                        request_from(args, [1]), "--trainer" if args.trainer is not None else "--train")


def cmd_align(args) -> int:
    block = block_config(args.draft_config)
    if block is not None:  # a DFlash or DSpark draft: the taps each engine takes (tpsim.cli.block_draft)
        return run_block(args, *block, "align")
    req = request(args)
    r = run_align(req)
    if r is None:  # a torchrun rank other than 0
        return 0
    if args.json:
        emit_json({**r.report.to_dict(), "assumed": r.assumptions, "unverified": r.stale and r.stale.to_dict()})
    else:
        for a in r.assumptions:
            say(f"assumed: {a}")
        print_report(r, req)
        if r.stale:
            say(r.stale.line)
    return 0 if r.report.aligned else 1


# --- output -------------------------------------------------------------------------------

def print_report(r: AlignResult, req: AlignRequest) -> None:
    report = r.report
    train, serve = report.train, report.serve
    say(f"tpsim align: train {train.convention} vs serve {serve.convention} on {train.num_layers} layers")
    for side in (train, serve):
        say(f"{side.role}: {named_ids(side.convention, side.ids_text())} (from {side.source}) -> "
            f"{positions_text(side.positions)} ({side.order})")
        for n in side.notes:
            say(f"note: {side.role}: {n}")
    if report.run is not None:
        m = report.run
        say(f"run: {req.model}, {m.weights} weights, TP={m.tp}, {m.dtype}, {m.tokens} tokens, "
            f"seed {m.seed}; cosine = mean over tokens of cos(train feature, serve feature)")
        for n in m.notes:
            say(f"note: {n}")
    run = report.run is not None
    columns = ["slot", "train id", "train position", "serve id", "serve position", "match"]
    table(columns + (["cosine"] if run else []) + ["reason"], [_row(s, run) for s in report.slots], notes=("reason",))
    for n in report.notes:
        say(f"note: {n}")
    if report.aligned:
        say(f"ALIGNED: {len(report.slots)} slots, the same positions in the same order "
            f"({positions_text(train.positions)})")
        return
    say("NOT ALIGNED: " + "; ".join(f"{LABELS[r.code]} ({r.text})" for r in report.reasons))
    if report.fix is not None:
        say(f"fix: {report.fix.text}")


def _row(s: Slot, run: bool) -> list[str]:
    def cell(v):
        return "-" if v is None else str(v)
    t, v = s.train, s.serve
    row = [str(s.index), cell(t and t.id), cell(t and (t.position or "unreachable")),
           cell(v and v.id), cell(v and (v.position or "unreachable")), "yes" if s.match else "NO"]
    if run:
        row.append("-" if s.cosine is None else f"{s.cosine:.6f}")
    return row + [list(map(str, s.reasons))]


