"""`tpsim explain`: the dataflow of one decoder layer (plus the embedding and the head) at a
TP degree, from a real run: every named point with its per-rank shape and placement, every
collective with its bytes (from the collective trace), and where each convention's capture
ids land. Also drawn as an SVG.

The run uses uninitialised weights: shapes, placements and collectives do not depend on
values, and an untouched page costs no memory, so V3 shapes run on a laptop. The model is
truncated to layers 0..k (the explained layer is the last one run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpsim.profiles.conventions import Convention, ids_for
from tpsim.capture.points import catalogue, position_of
from tpsim.capture.positions import Position
from tpsim.app.ranks import on_ranks
from tpsim.cli.diagram import Step, draw
from tpsim.cli.options import emit_json, integer
from tpsim.app.preflight import check_output
from tpsim.cli.pp_options import stage_rows
from tpsim.cli.run_args import load_source, one_tp, request_from
from tpsim.config.loader import with_overrides
from tpsim.base.errors import UsageError
from tpsim.base.atomic import write_text
from tpsim.parallel.ops import Op
from tpsim.parallel.placement import P, R, S0
from tpsim.run.jobs import points_job
from tpsim.app.preflight import check_timeout, check_world
from tpsim.app.request import tokens_for
from tpsim.app.run_options import pipeline_for
from tpsim.run.results import PointsResult
from tpsim.run.spec import ModelSource, RunSpec
from tpsim.base.ui import human_bytes, say, table


@dataclass
class Row:
    kind: str  # "point" | "collective"
    name: str  # point name, or "all_reduce <caller>"
    shape: str  # per-rank shape
    placement: str  # point placement, or the collective's result placement
    detail: str  # what it is / bytes
    capture: str = ""  # convention ids that capture this point


def capture_ids(point: str, L: int) -> str:
    """`sglang-ids 2 / vllm-ids 3 / ...`: the id each convention writes to capture this point."""
    pos = position_of(point)
    if pos is None:
        return ""
    out = []
    for conv in Convention:
        try:
            out.append(f"{conv.value} {ids_for(conv, [Position.parse(pos, L)], L)[0]}")
        except UsageError:
            pass
    return f"{pos}: " + (" / ".join(out) if out else "no convention captures it")


OP_WORDS = {Op.ALL_REDUCE: "all-reduce", Op.REDUCE_SCATTER: "reduce-scatter", Op.ALL_TO_ALL: "all-to-all combine"}


def in_this_run(name: str, detail: str, tap, colls: list, last_order: int) -> str:
    """The catalogue's description (written for `tp`) with the collective this run really used:
    a partial sum is reduced by the next all-reduce or reduce-scatter (under ar-fusion, the one
    fused into the next layer's norm); a reduced output comes after the collective just before
    it; a layer that is replicated (dp-attention's attention, embedding) reduces nothing, and
    its heads are all heads. `last_order`: the collectives run before the previous point."""
    if ".partial" in name and tap.placement != P:
        return detail.split(",")[0].replace("this rank's vocab rows looked up (zeros elsewhere)", "embedding lookup") \
            + ": computed whole on this rank (replicated weights), nothing to reduce"
    if ".partial" in name:
        by = next((c for c in colls[tap.order:] if c[0] in (Op.ALL_REDUCE, Op.REDUCE_SCATTER)), None)
        fused = by is not None and by[1].endswith("input_layernorm")
        return detail.replace("all-reduce", OP_WORDS[by[0]] + (f" (fused into {by[1]})" if fused else "")) \
            if by else detail
    if "after its all-reduce" in detail:
        prev = colls[tap.order - 1] if tap.order > last_order else None  # a collective since the previous point
        return detail.replace("after its all-reduce", f"after its {OP_WORDS.get(prev[0], prev[0])}" if prev
                              else "computed whole on this rank, no collective")
    if position_of(name) and tap.placement == P:  # ar-fusion: the MLP all-reduce moved into the next norm
        return detail + " (its MLP/MoE all-reduce is deferred into the next layer's input_layernorm: each rank " \
                        "holds its own summand plus the residual)"
    if "this rank's heads" in detail and tap.placement == S0:
        return detail.replace("this rank's heads", "all heads, this rank's own tokens")
    return detail


def build_rows(result: PointsResult, cfg, k: int, L_full: int) -> list[Row]:
    """Interleave layer k's (and the embedding's and head's) points with the collectives that
    ran between them, in the order of the real run."""
    what = {n: w for n, _, w in catalogue(cfg)}
    shown = [n for n in result.taps
             if n.startswith(("embed.", f"layers.{k}.")) or n in ("final", "logits.local", "logits")
             or n == f"layers.{k - 1}.out"]
    callers = ("model.embed_tokens", f"model.layers.{k}.", f"model.layers.{k + 1}.input_layernorm", "lm_head",
               "model.norm", "model.dp_token_counts")
    rows, done = [], 0
    colls = result.collectives
    for n in shown:
        tap = result.taps[n]
        for i in range(done, tap.order):
            op, caller, shape, dtype, nbytes = colls[i]
            if caller.startswith(callers):
                res = {Op.ALL_REDUCE: R, Op.ALL_GATHER: R, Op.REDUCE_SCATTER: S0, Op.ALL_TO_ALL: S0}.get(op, "?")
                rows.append(Row("collective", f"{op} ({caller})", "x".join(map(str, shape)), res,
                                f"{human_bytes(nbytes, binary=True)} per rank, {dtype}"))
        detail = in_this_run(n, what.get(n, ""), tap, colls, last_order=done)
        done = max(done, tap.order)
        if n == f"layers.{k - 1}.out":
            detail = f"layer {k}'s input: {detail}"
        rows.append(Row("point", n, "x".join(map(str, tap.shape)), tap.placement, detail, capture_ids(n, L_full)))
    return rows


def steps(by_rank: list[list[Row]]) -> list[Step]:
    """Every rank's rows side by side for the diagram (each rank ran the same points and
    collectives; only the shapes may differ)."""
    return [Step(rows[0].kind, rows[0].name, rows[0].placement, rows[0].detail, rows[0].capture,
                 tuple(tuple(int(d) for d in row.shape.split("x") if d) for row in rows))
            for rows in zip(*by_rank, strict=True)]


def cmd_explain(args) -> int:
    tp = one_tp(args)
    out = _svg_path(args)
    check_timeout(args.timeout)
    src = load_source(args, [tp])
    L, c = src.cfg.num_hidden_layers, src.cfg
    k = (c.first_moe_layer or 0) if args.layer is None else integer(args.layer, "--layer")
    if not 0 <= k < L:
        raise UsageError(f"--layer {k} does not exist: layers are 0..{L - 1}")
    # run layers 0..k; under ar-fusion also layer k+1, whose norm holds layer k's fused all-reduce
    req = request_from(args, [tp])
    mode = req.mode
    mode.check(src.cfg, tp)
    pipe = pipeline_for(req.pipeline, req.ids.server, src.cfg, [tp], mode)
    cfg = with_overrides(src.cfg, [f"num_hidden_layers={mode.layers_to_explain(k, L)}"])
    tokens = tokens_for(req.tokens, req.seq_len, req.seed, cfg)
    mode.check(cfg, tp, len(tokens))
    check_world(tp, args.device, args.ignore_limits)
    dtype = req.run_dtype
    stages = None if pipe is None else stage_rows(pipe, L, tp, len(tokens), c.hidden_size)
    home = None if stages is None else next(s for s in stages if s["layers"][0] <= k <= s["layers"][1])
    spec = RunSpec(ModelSource(src.name, cfg), args.seed, dtype, tuple(tokens), (), mode, mode.right_strategy,
                   args.device, args.backend, args.timeout)
    results = on_ranks(points_job, spec, tp, tp=tp, points=[], everything=True, weights=False)
    if results is None:
        return 0
    per_rank = sorted((r for r in results.values() if r is not None), key=lambda r: r.rank)
    same = all({n: t.shape for n, t in r.taps.items()} == {n: t.shape for n, t in per_rank[0].taps.items()}
               for r in per_rank)
    rows = build_rows(per_rank[0], cfg, k, L)
    kind = "MoE" if cfg.is_moe_layer(k) else "dense"
    title = (f"{args.model}: layer {k} ({kind}) of {L}, TP={tp}, mode {mode.name}, {len(tokens)} tokens, {dtype}; "
             f"shapes per rank{'' if same else ' (rank 0; ranks differ)'}")
    if args.json:
        emit_json({"model": str(args.model), "layer": k, "kind": kind, "tp": tp, "mode": mode.to_dict(),
                   "tokens": len(tokens), "dtype": dtype,
                   "same_on_every_rank": same, "rows": [r.__dict__ for r in rows],
                   "pipeline": None if pipe is None else {**pipe.to_dict(), "stages": stages}})
    else:
        if stages is not None:
            _print_stages(pipe, stages, home, k, tp)
        say(title)
        note = mode.note(mode.right_strategy, len(tokens), L)
        if note:
            say(f"note: {note}")
        _print_rows(rows)
        say("Placements: Replicate() = every rank holds the whole tensor; Shard(dim=-1) = each rank "
            "a contiguous 1/tp of the last dim; Shard(dim=0) = each rank its own tokens; Partial(sum) = "
            "each rank a summand (before its all-reduce or reduce-scatter).")
        say(f"Captured by: the id each convention writes for that position (L={L}); engines compute "
            "hidden + residual at the start of the next layer, after every all-reduce.")
    if out is not None:
        write_text(out, draw(steps([rows, *(build_rows(r, cfg, k, L) for r in per_rank[1:])]), title))
        if not args.json:
            say(f"diagram: {out}")
    return 0


def _svg_path(args) -> Path | None:
    """--svg as a path the run may write (None: no diagram)."""
    if args.svg is not None and not args.svg.strip():
        raise UsageError("--svg is empty; give a file name such as --svg explain.svg")
    out = None if args.svg is None else Path(args.svg)
    if out is not None:
        check_output(out, "--svg", "explain.svg", args.force)
    return out


def _print_stages(pipe, stages: list[dict], home: dict, k: int, tp: int) -> None:
    """--pp: each stage's layers, ranks and traffic, and the stage layer k runs on."""
    say(f"pipeline parallel --pp {pipe.size} x --tp {tp} = {pipe.size * tp} ranks, layers split by "
        f"{pipe.split.value}'s get_pp_indices ({pipe.split.rule}):")
    table(["stage", "layers", "ranks", "holds", "receives", "sends"],
          [[str(s["stage"]), f"{s['layers'][0]}..{s['layers'][1]}", ",".join(map(str, s["ranks"])),
            ", ".join(s["holds"]), "; ".join(s["recv"]) or "-", "; ".join(s["send"]) or "-"] for s in stages],
          notes=("holds", "receives", "sends"))
    say(f"layer {k} runs on stage {home['stage']} (ranks {','.join(map(str, home['ranks']))}); below, its "
        f"dataflow in that stage's TP={tp} group")


def _print_rows(rows: list[Row]) -> None:
    table(["point / collective", "shape", "placement", "what", "captured by"],
          [[f"-> {r.name.split()[0]}" if r.kind == "collective" else r.name, r.shape, r.placement,
            f"{r.name.split(maxsplit=1)[1][1:-1]}: {r.detail}" if r.kind == "collective" else r.detail,
            r.capture] for r in rows], notes=("captured by",), whole=("placement",))
