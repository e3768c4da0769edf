"""`tpsim check`: run the model at each TP degree on real ranks and check the capture."""

from __future__ import annotations

import argparse

from tpsim.cli.options import emit_json
from tpsim.cli.pd_options import check_alone, draft_hidden, pd_sizes
from tpsim.cli.pp_options import pp_degree
from tpsim.cli.run_args import pp_tp_degrees, run_spec, tp_degrees
from tpsim.app.check import run_check, run_graphs
from tpsim.app.preflight import check_world
from tpsim.app.disaggregation import PdAsk, PdReport, capture_server, plan, run_pd
from tpsim.app.report import TOLERANCE_METRIC, CheckReport, graph_rows, ops_text, prefix_note, prefix_rows
from tpsim.base.ui import say, table
from tpsim.run.spec import ModelSource
from tpsim.profiles.conventions import named_ids


def cmd_check(args) -> int:
    if getattr(args, "disaggregate", None) is not None:
        return check_disaggregated(args)
    draft_hidden(args)  # --draft-hidden without --disaggregate: refused
    tps = pp_tp_degrees(args, pp_degree(args)) or tp_degrees(args)
    spec, res = run_spec(args, tps)
    if res.failed:  # the engine fails before it captures anything
        return engine_failure(args, res)
    report = run_check(spec, res, tps)
    graphed = run_graphs(spec, tps) if spec.graphs is not None else None
    if report is None:  # a torchrun rank other than 0
        return 0
    if graphed is not None:
        report.graphs = graph_rows(spec, graphed)
    if args.json:
        emit_json(report.to_dict())
    else:
        print_report(report, tps)
    return 0 if report.ok else 1


def check_disaggregated(args) -> int:
    """--disaggregate P:D: the PD hand-off replayed on P + D ranks (exit 1: the engine fails or a decode
    rank's buffer differs from what was sent)."""
    check_alone(args)
    prefill, decode = pd_sizes(args.disaggregate)
    # the world first: the spec below is built at the prefill degree, and its refusals would name a --tp never given
    check_world(prefill + decode, args.device, args.ignore_limits, f"--disaggregate {prefill}:{decode}")
    ask = PdAsk(prefill, decode, draft_hidden(args))
    source = ModelSource.load(args.model, args.override or [], [])
    for role, tp in (("prefill", prefill), ("decode", decode)):
        source.cfg.check_tp(tp, f"--disaggregate {prefill}:{decode}: the {role} server's TP {tp}")
    server, note = capture_server(args.server)
    spec, res = run_spec(argparse.Namespace(**{**vars(args), "server": server, "tp": None}), [prefill], source)
    if res.failed:  # the engine fails on these ids before anything is handed over
        return engine_failure(args, res)
    pd, version = plan(ask, args.server, spec, args.ignore_limits)
    report = run_pd(spec, pd, version)
    if report is None:  # a torchrun rank other than 0
        return 0
    print_pd(report, spec, res, [note] if note else [])
    return 0 if report.ok else 1


def print_pd(report: PdReport, spec, res, notes: list[str]) -> None:
    pd, cfg = report.pd, spec.cfg
    w, t = pd.widths, pd.transfer
    say(f"tpsim check --disaggregate {pd.prefill}:{pd.decode}: {spec.source.name} (L={cfg.num_hidden_layers}, "
        f"hidden={w.target}), {spec.dtype}, {len(spec.tokens)} tokens, seed {spec.seed}")
    for note in [*res.notes, *notes]:
        say(f"note: {note}")
    say(f"capture: {res.positions_text} (width {w.num_aux} x {w.target} = {w.num_aux * w.target}) on the prefill "
        f"server's ranks 0..{pd.prefill - 1}; the draft's hidden size {w.draft}"
        + (" (the target's: --draft-hidden not given)" if w.draft == w.target else ""))
    say(f"hand-off: {pd.why}")
    if t is not t.TARGET_AUX:
        say(f"note: the draft's state is a seeded EAGLE-3 draft's ({w.draft} wide, seed {spec.seed}) step 0 over the "
            "capture, the last token's pre-norm hidden (no draft checkpoint is read)")
    say(f"PD disaggregation: the prefill server (TP {pd.prefill}) sends {t.sent_text(w)} values per request "
        f"({t.what}) into the decode server's (TP {pd.decode}, ranks {pd.prefill}..{pd.world - 1}) "
        f"{t.buffer(w)}-wide buffer")
    if report.finding is not None:
        say(f"FAIL: {report.finding}")
    elif report.mismatched:
        say(f"FAIL: decode ranks {report.mismatched} hold a buffer other than the one the prefill server sent")
    else:
        say(f"PASS: every decode rank's {t.buffer(w)}-wide buffer equals what the prefill server's rank 0 sent, "
            "bitwise")


def engine_failure(args, res) -> int:
    if args.json:
        emit_json({"ok": False, "convention": res.to_dict(), "rows": []})
    else:
        say(f"tpsim check: {res.convention} on {res.num_layers} layers, ids "
            f"{'default' if res.ids is None else res.ids}")
        if res.unverified:
            say(res.unverified.line)
        for f in res.findings:
            say(f"FAIL: {f}")
    return 1


def print_report(report: CheckReport, tps: list[int]) -> None:
    spec, res = report.spec, report.resolution
    cfg, mode, dtype = spec.cfg, spec.mode, spec.dtype
    H, L, n = cfg.hidden_size, cfg.num_hidden_layers, len(spec.positions)
    ids = "default " + str(res.internal) if res.ids is None else str(res.ids)
    fp8 = f" in fp8 ({cfg.fp8_block[0]}x{cfg.fp8_block[1]} blocks)" if cfg.fp8_block else ""
    say(f"tpsim check: {spec.source.name} (L={L}, hidden={H}), {dtype}, {len(spec.tokens)} tokens, "
        f"seed {spec.seed}, {spec.source.weights} weights{fp8}")
    for note in spec.source.notes:
        say(f"note: {note}")
    say(f"capture: {named_ids(res.convention, ids)} -> {res.positions_text} (width {n} x {H} = {n * H})")
    if res.unverified:
        say(res.unverified.line)
    for note in res.notes:
        say(f"note: {note}")
    for note in run_notes(spec):
        say(f"note: {note}")
    pipe = spec.pipeline
    say(f"tolerance: {TOLERANCE_METRIC} <= {report.tolerance:.0e} ({dtype}{', fp8 weights' if fp8 else ''}); "
        "ranks identical means bitwise equal to the group's rank 0")
    plain = mode.plain and pipe is None
    table(
        ["TP", "ranks", "capture shape per rank", "expected", "ranks identical", "rel err vs TP=1",
         "logits rel err", "all-reduces (expected)" if plain else "collectives (expected)", "ok"],
        [[str(r.tp), str(r.ranks), r.shapes, " ".join(map(str, r.expected_shape))
          if isinstance(r.expected_shape[0], str) else str(r.expected_shape),
          {True: "yes", False: "NO", None: "own tokens"}[r.identical],
          "-" if r.rel_err is None else f"{r.rel_err:.2e}",
          "-" if r.logits_rel_err is None else f"{r.logits_rel_err:.2e}",
          f"{r.all_reduces} ({r.expected_all_reduces})" if plain
          else f"{ops_text(r.collectives)} ({ops_text(r.expected_collectives)})" if not r.stage_collectives
          else "; ".join(f"stage {c.stage}: {ops_text(c.collectives)} ({ops_text(c.expected)})"
                         for c in r.stage_collectives),
          "ok" if r.ok else "FAIL"]
         for r in report.rows], notes=("capture shape per rank", "expected", "collectives (expected)"))
    for r in report.rows:
        if r.routing_note:
            say(f"note TP={r.tp}: {r.routing_note}")
    say_verdict(report, tps, n, H)
    rows_right = prefix_rows(report)
    if rows_right:
        say(rows_right)
    for r in report.rows:
        for why in r.failures:
            say(f"FAIL TP={r.tp}: {why}")
    for f in res.findings:
        say(f"FAIL: {f}")
    print_graphs(report)



def say_verdict(report: CheckReport, tps: list[int], n: int, H: int) -> None:
    """The PASS line (or that the ranks agree but the engine breaks the capture) for the check's rows."""
    spec = report.spec
    mode, pipe, plain = spec.mode, spec.pipeline, spec.mode.plain and spec.pipeline is None
    degrees = ", ".join(map(str, tps))
    word = "PASS" if report.ok else "the ranks agree, but the engine breaks the capture (below)"
    if all(r.ok for r in report.rows) and mode.rank_local:
        say(f"{word}: each rank's capture is its own tokens x {n} x {H} and equals TP=1 "
            f"on that rank's sequence at TP {degrees}")
    elif all(r.ok for r in report.rows) and spec.prefix_cached:
        say(f"{word}: the capture after the cache hit is [{spec.forward_tokens}, {n} x {H}] (tokens "
            f"{spec.prefix_cached}..{len(spec.tokens) - 1}, the ones the prefill runs), identical on every rank and "
            f"equal to those rows of TP=1's full prompt at TP {degrees}")
    elif all(r.ok for r in report.rows):
        say(f"{word}: capture is [T, {n} x {H}], all tokens, identical on every rank and equal to TP=1 "
            f"at TP {degrees}" + (f" x PP {pipe.size}, against TP=1, PP=1" if pipe else "")
            + ("" if plain or pipe else f" (mode {mode.name}, strategy {spec.strategy})")
            + ("; where routing agrees (see the notes)" if any(r.routing_note for r in report.rows) else ""))


def run_notes(spec) -> list[str]:
    """What the mode, a cached prefix and the pipeline do to this run, a line each."""
    L, pipe = spec.cfg.num_hidden_layers, spec.pipeline
    notes = [spec.mode.note(spec.strategy, spec.forward_tokens, L), spec.prefix_cached and prefix_note(spec)]
    if pipe is not None:
        stages = ", ".join(f"{s}" for s in pipe.stages(L, 1))
        notes.append(f"pipeline parallel --pp {pipe.size} ({pipe.split.value}'s get_pp_indices: {stages}; stage s "
                     f"on ranks s*tp..s*tp+tp-1); a stage's aux hidden states are {pipe.handoff.value}"
                     + (f" ({pipe.why})" if pipe.why else ""))
    return [n for n in notes if n]


def print_graphs(report: CheckReport) -> None:
    g = report.spec.graphs
    if g is None:
        return
    say(f"CUDA graphs: {g.why}; one graph of {g.tokens} tokens, captured at start-up"
        + ("" if report.spec.device == "cuda" else " (CPU: a recorded replay of the capture set it froze)"))
    table(["TP", f"graphed ({g.tokens} tokens) captures", f"eager ({len(report.spec.tokens)} tokens) captures",
           "rel err vs TP=1", "ok"],
          [[str(r.check.tp), ", ".join(r.check.graphed) or "nothing", ", ".join(r.check.eager) or "nothing",
            "-" if r.check.rel_err is None else f"{r.check.rel_err:.2e}", "ok" if r.ok else "FAIL"]
           for r in report.graphs])
    for r in report.graphs:
        for why in r.failures:
            say(f"FAIL TP={r.check.tp}: {why}")
    if report.graphs and all(r.ok for r in report.graphs):
        say(f"PASS: CUDA-graphed batches capture the configured positions at TP "
            f"{', '.join(str(r.check.tp) for r in report.graphs)}")
