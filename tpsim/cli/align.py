"""`tpsim align`: does the trainer of an EAGLE-3 draft capture the same residual-stream positions,
in the same slot order, as the server that runs it? (tpsim.offline.align compares; this module
reads the options, runs the model when --model is given, and prints.)

Exit 0 aligned, 1 not aligned, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import torch.nn.functional as F

from tpsim.capture import Position
from tpsim.profiles.conventions import named_ids, parse_convention_ids, refuse_convention_as_profile
from tpsim.offline.align import (LABELS, ModelRun, Report, Slot, align, make_side, positions_text,
                                 read_draft_config)
from tpsim.app.ranks import on_ranks
from tpsim.cli.options import EXECUTION_OPTIONS, emit_json, positive_int
from tpsim.cli.parser import refuse_without
from tpsim.cli.run_args import load_source, one_tp, run_spec
from tpsim.config.loader import DEFAULT_MODEL_TYPE
from tpsim.base.errors import UsageError
from tpsim.run.jobs import capture_job
from tpsim.app.preflight import check_divides_world, check_timeout
from tpsim.app.ranks import is_reporting_process
from tpsim.profiles.draft import write_ids_hint
from tpsim.profiles.profile import Profile
from tpsim.profiles.fingerprints import unverified
from tpsim.profiles.vllm import assumed
from tpsim.profiles.registry import lookup, serving
from tpsim.offline.sides import align_profiles, side_from_config
from tpsim.run.spec import ModelSource
from tpsim.base.ui import say, table


def check_inputs(args) -> None:
    """Exactly one input style, complete; a layer count from exactly one place."""
    by_config = any(v is not None for v in (args.draft_config, args.trainer, args.server))
    by_ids = args.serve is not None or (args.train is not None and not by_config)
    if by_ids and by_config:
        raise UsageError("give either --train/--serve or --draft-config/--trainer/--server, not both")
    if not by_ids and not by_config:
        raise UsageError("nothing to align: give --train CONVENTION:IDS --serve CONVENTION:IDS, or "
                         "--draft-config PATH --server sglang|vllm")
    for opt, v in (("--train", args.train), ("--serve", args.serve)) if by_ids else ():
        if v is None:
            raise UsageError(f"{opt} is missing; give both --train CONVENTION:IDS and --serve CONVENTION:IDS")
    if by_config:
        _check_config_inputs(args)
    if (args.num_layers is None) == (args.model is None):
        raise UsageError("align needs the target's layer count: give --num-layers L or --model M (not both)")
    if args.override and args.model is None:
        raise UsageError("--override changes the --model config; give --model too")


def _check_config_inputs(args) -> None:
    if args.draft_config is None:
        raise UsageError("--server with a draft's ids reads its config: give --draft-config PATH (the draft's "
                         "config.json), or compare conventions with --train CONVENTION:IDS --serve CONVENTION:IDS")
    if args.server is None:
        raise UsageError("--draft-config needs --server PROFILE, e.g. --server sglang or --server vllm@0.25.0 "
                         "(tpsim profiles lists them)")
    if args.trainer is not None and args.train is not None:
        raise UsageError("--trainer is the old name of --train; give one of them")


def model_type(args, src: ModelSource | None) -> str:
    return DEFAULT_MODEL_TYPE if src is None else src.cfg.model_type


def align_sides(args, L: int, kind: str) -> tuple[Report, Profile | None]:
    """The report, and the serving profile when the sides come from a draft config."""
    if args.draft_config is None:
        out = []
        for role, text in (("train", args.train), ("serve", args.serve)):
            conv, ids = parse_convention_ids(text, f"--{role}")
            out.append(make_side(role, conv, ids, L, f"--{role} {text}"))
        return align(out[0], out[1]), None
    draft = read_draft_config(args.draft_config)
    serve_p = serving(args.server, kind)
    if ":" in args.server:  # the server names the model: the trainer trained for the same one
        kind = args.server.partition("+")[0].partition(":")[2].strip()
    trainer = args.train or args.trainer or "specforge"
    train_p = lookup(refuse_convention_as_profile(trainer, "--train" if args.train else "--trainer"), kind)
    train, _ = side_from_config("train", train_p, draft, L)
    serve, _ = side_from_config("serve", serve_p, draft, L)
    return align_profiles(train, serve, serve_p), serve_p


def fix_hint(report: Report, serve: Profile | None) -> str:
    ids = report.fix.ids
    if serve is None:
        return f"--serve {report.serve.convention}:{','.join(map(str, ids))}"
    return write_ids_hint(serve, ids)


def cmd_align(args) -> int:
    check_inputs(args)
    refuse_without(args, "--model", args.model is not None, {"tp": "--tp", **EXECUTION_OPTIONS})
    src, tp = None, one_tp(args) if args.model is not None else None
    if args.model is not None:
        check_timeout(args.timeout)
        src = load_source(args, [tp])
        L = src.cfg.num_hidden_layers
    else:
        L = positive_int(args.num_layers, "--num-layers")
    report, serve_p = align_sides(args, L, model_type(args, src))
    if src is not None:
        report.run = run_model(args, src, tp, report)
        if not is_reporting_process():
            return 0
    if report.fix is not None and report.fix.ids is not None:
        report.fix.text += f" ({fix_hint(report, serve_p)})"
    stale = None if serve_p is None else unverified(args.server, model_type(args, src))
    runner = None if serve_p is None else assumed(serve_p)
    if args.json:
        emit_json({**report.to_dict(), "assumed": runner, "unverified": stale and stale.to_dict()})
    else:
        if runner is not None:
            say(f"assumed: {runner}")
        print_report(report, args)
        if stale:
            say(stale.line)
    return 0 if report.aligned else 1


# --- running the model --------------------------------------------------------------------

def run_model(args, src: ModelSource, tp: int, report: Report) -> ModelRun | None:
    """Capture every position either side names once, at TP=`tp`, and set each slot's cosine
    (mean over tokens) between the feature training saw and the one the server captures."""
    union = sorted({p for side in (report.train, report.serve) for p in side.positions if p is not None},
                   key=Position.sort_key)
    spec, _ = run_spec(args, [tp], source=src, positions=union)
    check_divides_world(tp)
    info = ModelRun(args.model, src.weights, src.fingerprint, tp, spec.dtype, args.seed, len(spec.tokens),
                    [str(p) for p in union], list(src.notes))
    if not union:
        return info
    results = on_ranks(capture_job, spec, tp, tp=tp)
    if results is None:
        return None
    got = [r for r in results.values() if r is not None]
    cap = next(r.capture for r in got if r.capture is not None)
    info.identical_on_ranks = all(r.identical for r in got)
    set_cosines(report.slots, cap, union, src.cfg.hidden_size)
    return info


def set_cosines(slots: list[Slot], cap, union: list[Position], H: int) -> None:
    """cos(train feature, serve feature) per token, averaged, in float64, for every slot both
    sides reach."""
    for s in slots:
        if s.train is None or s.serve is None or s.train.position is None or s.serve.position is None:
            continue
        a, b = (cap[:, k * H:(k + 1) * H].double() for k in
                (union.index(s.train.position), union.index(s.serve.position)))
        s.cosine = float(F.cosine_similarity(a, b, dim=-1).mean())


# --- output -------------------------------------------------------------------------------

def print_report(report: Report, args) -> None:
    train, serve = report.train, report.serve
    say(f"tpsim align: train {train.convention} vs serve {serve.convention} on {train.num_layers} layers")
    for side in (train, serve):
        say(f"{side.role}: {named_ids(side.convention, side.ids_text())} (from {side.source}) -> "
            f"{positions_text(side.positions)} ({side.order})")
        for n in side.notes:
            say(f"note: {side.role}: {n}")
    if report.run is not None:
        r = report.run
        say(f"run: {args.model}, {r.weights} weights, TP={r.tp}, {r.dtype}, {r.tokens} tokens, "
            f"seed {r.seed}; cosine = mean over tokens of cos(train feature, serve feature)")
        for n in r.notes:
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


