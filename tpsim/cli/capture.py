"""`tpsim capture`: capture on real ranks and write a safetensors file (or, with --points,
each rank's local tensor of each named point, one file per rank)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tpsim import __version__
from tpsim.capture.points import check_points
from tpsim.cli.run_args import load_source, one_tp, run_spec
from tpsim.app.preflight import check_output
from tpsim.base.errors import UsageError
from tpsim.capture.files import rank_dump_path, rank_dumps_present, write_capture, write_rank_dumps
from tpsim.parallel.placement import R, S0
from tpsim.run.jobs import capture_job, points_job
from tpsim.app.ranks import on_ranks
from tpsim.run.spec import ModelSource


def check_not_an_input(outs: list[Path], source: ModelSource) -> None:
    """Refuse to replace a file this run reads (its checkpoint's weights, its config)."""
    reads = set(source.reads())
    for out in outs:
        if out.resolve() in reads:
            raise UsageError(f"--out {out} is a file this run reads (--model {source.name}); write the capture "
                             "somewhere else")


def cmd_capture(args) -> int:
    tp = one_tp(args)
    out = Path(args.out)
    check_output(out, "--out", "capture.safetensors", args.force or args.points is not None)  # --points: per rank below
    if args.points is not None:
        return capture_points(args, tp, out)
    spec, res = run_spec(args, [tp])  # an engine that refuses --pp at start-up: res.failed, said below
    if spec.mode.tbo and not spec.strategy.micro_batches:  # the engine's capture misses the split layers' slots
        raise UsageError("capture --tbo writes the micro-batch capture only (--strategy micro-batches); "
                         "tpsim check --tbo replays the engine's narrower capture and names the missing slots")
    check_not_an_input([out], spec.source)
    if res.failed:  # the engine fails before it captures anything
        if res.unverified:
            print(res.unverified.line, file=sys.stderr)
        for f in res.findings:
            print(f"tpsim: error: {f}; nothing written", file=sys.stderr)
        return 1
    if spec.pipeline is not None:
        raise UsageError(f"capture runs no pipeline: --pp {spec.pipeline.size} only replays an engine that refuses it "
                         f"at start-up; tpsim check --pp {spec.pipeline.size} replays the stages")
    results = on_ranks(capture_job, spec, tp, tp=tp)
    if results is None:
        return 0
    got = sorted((r for r in results.values() if r is not None), key=lambda r: r.group_rank)
    mode, strategy = spec.mode, spec.strategy
    if any(r.identical is False for r in got):
        print(f"tpsim: error: the capture differs between ranks at TP={tp} (mode {mode.name}, strategy {strategy}); "
              f"nothing written; tpsim check --mode {mode.name} --strategy {strategy} diagnoses it", file=sys.stderr)
        return 1
    if mode.runs_own_tokens(tp):  # each rank its own sequence: concatenated in rank order
        cap = torch.cat([r.capture for r in got])
        placement = f"{S0}: rank r's own sequence, rows " + "+".join(str(r.capture.shape[0]) for r in got)
    else:
        cap, placement = next(r.capture for r in got if r.capture is not None), str(R)
    meta = {"layers": "default" if res.ids is None else ",".join(map(str, res.ids)),
            "convention": res.convention, "positions": res.positions_text, "tp": str(tp), "dtype": spec.dtype,
            "seed": str(spec.seed), "config_sha256": spec.cfg.sha256(), "placement": placement,
            "num_layers": str(spec.cfg.num_hidden_layers),
            "mode": mode.name, "capture_strategy": strategy.value,
            "weights": spec.source.weights, "tpsim_version": __version__}
    if spec.source.fingerprint:
        meta["checkpoint_fingerprint"] = spec.source.fingerprint
    if args.server is not None:
        meta["server"] = args.server
    if res.unverified:
        meta["unverified"] = res.unverified.line
    write_capture(out, cap, list(spec.tokens), meta)
    for n in spec.source.notes:
        print(f"note: {n}")
    if res.unverified:
        print(res.unverified.line)
    where = placement if placement != R else f"identical on all {tp} rank{'s' if tp > 1 else ''}"
    print(f"wrote {out}: aux_hidden_states {list(cap.shape)} ({res.positions_text}), input_ids "
          f"[{len(spec.tokens)}], TP={tp}, mode {mode.name}, {where}")
    for f in res.findings:  # what the engine captures, written as it captures it
        print(f"warning: {f}")
    return 0


def capture_points(args, tp: int, out: Path) -> int:
    """`capture --points`: each rank's local tensor of each named point, one file per rank."""
    if args.layers is not None:
        raise UsageError("--points and --layers both name what to capture; give one of them")
    if args.pp is not None:
        raise UsageError("--points dumps each rank's tensors without a pipeline; drop --pp")
    src = load_source(args, [tp])
    for r in range(tp):
        check_output(rank_dump_path(out, r), "--out", "capture.safetensors", args.force)
    stale = [path for r, path in rank_dumps_present(out).items() if r >= tp]
    if stale and not args.force:
        raise UsageError(f"--out {out}: {stale[0].name} is left from an earlier run at a larger TP; pass --force to "
                         "replace that run's files, or give a new name")
    check_not_an_input([rank_dump_path(out, r) for r in range(tp)], src)
    points = check_points(src.cfg, [p.strip() for p in args.points.split(",") if p.strip()])
    if not points:
        raise UsageError("--points is empty; name points like layers.3.attn.o_proj.partial")
    if args.strategy is not None:
        raise UsageError("--strategy applies to --layers captures; --points dumps each rank's local tensors as they are")
    spec, _ = run_spec(args, [tp], source=src, positions=())
    results = on_ranks(points_job, spec, tp, tp=tp, points=points)
    if results is None:
        return 0
    meta = {"tp": str(tp), "dtype": spec.dtype, "seed": str(args.seed), "config_sha256": src.cfg.sha256(),
            "mode": spec.mode.name,
            "hidden_size": str(src.cfg.hidden_size), "weights": src.weights, "tpsim_version": __version__}
    ranks = sorted((r for r in results.values() if r is not None), key=lambda r: r.rank)
    write_rank_dumps(out, tp, {r.rank: r.taps for r in ranks}, list(spec.tokens), meta)
    for path in stale:  # one run's files only: a reader would take a wider run's ranks for this one's
        path.unlink()
    first = ranks[0].taps
    print(f"wrote {rank_dump_path(out, 0)} .. {rank_dump_path(out, tp - 1).name}: "
          + ", ".join(f"{n} {list(first[n].shape)} {first[n].placement}" for n in points))
    return 0
