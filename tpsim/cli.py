"""`tpsim ...` / `python -m tpsim ...`.

Exit codes: 0 every property holds; 1 a property failed; 2 bad input; 3 a rank failed or
stalled; 4 an output could not be written (the previous file, if any, is untouched).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from tpsim import __version__
from tpsim.capture import CONVENTIONS, Resolution, check_convention, ids_for, resolve
from tpsim.config import ModelConfig, load_config, with_overrides
from tpsim.errors import RankError, UsageError
from tpsim.parallel.launch import under_torchrun
from tpsim.run.jobs import capture_job, check_job, points_job

BUILTIN_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_MODEL = "configs/tiny.yaml"
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}  # ‖TP=t − TP=1‖ / ‖TP=1‖


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(f"{message} (see {self.prog} --help)")

    def _get_values(self, action, arg_strings):
        # `--opt=--`: argparse (CPython < 3.12) drops the "--" and hands the option an empty list
        if arg_strings == ["--"] and action.option_strings and action.nargs in (None, "?"):
            raise UsageError(f"{'/'.join(action.option_strings)} needs a value, not '--'")
        return super()._get_values(action, arg_strings)


MAX_TOKENS = 2**20  # far beyond any real context here (V3: 163840); keeps a typo from allocating 8 TB of ids


def seed_value(text: str) -> int:
    """--seed: an integer in [0, 2**63) (the generators take 64-bit seeds)."""
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"--seed {text!r} is not an integer, e.g. --seed 0") from None
    if not 0 <= v < 2**63:
        raise UsageError(f"--seed {v} is out of range; use 0 <= seed < 2**63")
    return v


# --- argument helpers --------------------------------------------------------------------

LIST_EXAMPLES = {"--tp": "1,2,4,8", "--layers": "--layers=-1,2,30", "--tokens": "1,2,3"}


def int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of integers, "
                         f"e.g. {LIST_EXAMPLES.get(option, '1,2,3')}") from None
    return values


def positive_int(text: str, option: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not an integer") from None
    if v < 1:
        raise UsageError(f"{option} {v} must be at least 1")
    return v


def model_path(text: str) -> Path:
    p = Path(text)
    if not p.exists():
        for cand in (BUILTIN_CONFIGS / text, BUILTIN_CONFIGS / f"{text}.yaml"):
            if cand.is_file():
                return cand
        if text == DEFAULT_MODEL and (BUILTIN_CONFIGS / "tiny.yaml").is_file():
            return BUILTIN_CONFIGS / "tiny.yaml"
    return p


def load_model_config(text: str) -> ModelConfig:
    """The config of --model (a file, a built-in name, or an HF directory's config.json)."""
    return load_config(model_path(text))


@dataclass
class ModelSource:
    """What --model names: its config (with --override applied) and, for an HF directory, the
    validated checkpoint the ranks will read (`notes` say what it holds beyond the config)."""

    cfg: ModelConfig
    checkpoint: Path | None = None
    fingerprint: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def weights(self) -> str:
        return f"checkpoint {self.checkpoint}" if self.checkpoint else "seeded random"


def load_model(args, tps: list[int]) -> ModelSource:
    p = model_path(args.model)
    cfg = with_overrides(load_config(p), args.override or [])
    for t in tps:
        cfg.check_tp(t)
    if not p.is_dir():
        return ModelSource(cfg)
    from tpsim.checkpoint import Checkpoint, validate
    ckpt = Checkpoint(p)
    return ModelSource(cfg, p.resolve(), ckpt.fingerprint(), validate(ckpt, cfg))


def dtype_for(args) -> str:
    if args.dtype == "auto":
        return "bfloat16" if args.device == "cuda" else "float32"
    return args.dtype


def layer_ids(args) -> list[int] | None:
    return None if args.layers is None else int_list(args.layers, "--layers")


def tokens_for(args, cfg: ModelConfig) -> list[int]:
    from tpsim.run.jobs import input_ids_for
    if getattr(args, "tokens", None) is not None:
        if args.seq_len is not None:
            raise UsageError("--tokens and --seq-len both say which tokens to run; give one of them")
        ids = int_list(args.tokens, "--tokens")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise UsageError(f"--tokens: id {bad[0]} is outside the vocabulary 0..{cfg.vocab_size - 1} "
                             f"(vocab_size={cfg.vocab_size})")
        return ids
    n = positive_int(args.seq_len or "16", "--seq-len")
    if n > MAX_TOKENS:
        raise UsageError(f"--seq-len {n} is more tokens than tpsim runs (at most {MAX_TOKENS})")
    if n > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len {n} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    return input_ids_for(cfg, args.seed, n)


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# --- tpsim resolve -----------------------------------------------------------------------

def cmd_resolve(args) -> int:
    if args.num_layers is None and args.model is None:
        raise UsageError("resolve needs --num-layers L or --model M")
    if args.num_layers is not None and args.model is not None:
        raise UsageError("--num-layers and --model both give the layer count; give one of them")
    L = positive_int(args.num_layers, "--num-layers") if args.num_layers is not None \
        else load_model_config(args.model).num_hidden_layers
    res = resolve(args.convention, layer_ids(args), L)
    equivalents = {}
    for conv in ("sglang", "sglang-boundary", "vllm", "specforge", "hf", "eagle"):
        try:
            equivalents[conv] = ids_for(conv, res.positions, L)
        except UsageError as e:
            equivalents[conv] = f"unreachable: {e}"
    if args.json:
        emit_json({**res.to_dict(), "equivalent_ids": equivalents})
        return 0
    ids = "default" if res.ids is None else ",".join(map(str, res.ids))
    print(f"{res.convention} ids {ids} on {L} layers -> {', '.join(map(str, res.positions))}")
    print(f"{res.internal_name}: {res.internal}")
    for n in res.notes:
        print(f"note: {n}")
    print("same positions in other conventions:")
    for conv, v in equivalents.items():
        print(f"  {conv:16} {v if isinstance(v, str) else ','.join(map(str, v))}")
    return 0


# --- tpsim check -------------------------------------------------------------------------

def tp_degrees(args) -> list[int]:
    if args.tp is None:
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            return [t for t in range(1, world + 1) if world % t == 0]
        return [1, 2, 4, 8]
    tps = int_list(args.tp, "--tp")
    for t in tps:
        if t < 1:
            raise UsageError(f"--tp {t} must be a positive integer")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        for t in tps:
            if world % t:
                raise UsageError(f"--tp {t} does not divide the torchrun world size {world}; "
                                 f"use degrees that divide {world}")
    return sorted(set(tps))


def prepare(args, tps: list[int]):
    """Everything validated before any rank starts: config, degrees, capture, tokens, memory."""
    from tpsim.run.ranks import check_memory, check_world
    if not 0 < args.timeout < timedelta.max.total_seconds():  # also rejects nan and inf
        raise UsageError(f"--timeout {args.timeout:g} must be a positive, finite number of seconds "
                         f"(below {timedelta.max.total_seconds():.2g}), e.g. 60")
    src = load_model(args, tps)
    res = resolve(args.convention, layer_ids(args), src.cfg.num_hidden_layers)
    tokens = tokens_for(args, src.cfg)
    args.mode_spec, args.capture_strategy = mode_from(args, src.cfg, tps, len(tokens))
    check_world(max(tps), args.device, args.force)
    check_memory(src.cfg, tps, dtype_for(args), args.device, args.force, str(args.model))
    return src, res, tokens


def job_args(src: ModelSource, args, res: Resolution, tokens: list[int]) -> dict:
    """The keyword arguments every rank job takes, as plain picklable values."""
    return dict(cfg=src.cfg.to_dict(), seed=args.seed, dtype=dtype_for(args), input_ids=tokens,
                positions=[str(p) for p in res.positions],
                checkpoint=None if src.checkpoint is None else str(src.checkpoint),
                mode=args.mode_spec.to_dict() if getattr(args, "mode_spec", None) else None,
                strategy=getattr(args, "capture_strategy", None))


def cmd_check(args) -> int:
    from tpsim.run.ranks import is_reporting_process, run_on_ranks
    from tpsim.ui import ProgressLine, stdout, table
    tps = tp_degrees(args)
    src, res, tokens = prepare(args, tps)
    cfg, dtype = src.cfg, dtype_for(args)
    progress = ProgressLine(enabled=is_reporting_process())
    try:
        results = run_on_ranks(check_job, max(tps), device=args.device, backend=args.backend,
                               timeout_s=args.timeout, progress=progress, tps=tps,
                               **job_args(src, args, res, tokens))
    finally:
        progress.stop()
    if results is None:  # a torchrun rank other than 0
        return 0
    rows = [r for per_rank in results.values() for r in per_rank]
    mode = args.mode_spec
    report = summarize(cfg, res, tokens, dtype, tps, rows, mode)
    report["capture_strategy"] = args.capture_strategy
    report.update(weights=src.weights, checkpoint_fingerprint=src.fingerprint, notes=src.notes)
    if args.json:
        emit_json(report)
    else:
        H, L = cfg.hidden_size, cfg.num_hidden_layers
        ids = "default " + str(res.internal) if res.ids is None else str(res.ids)
        stdout.print(f"tpsim check: {args.model} (L={L}, hidden={H}), {dtype}, {len(tokens)} tokens, "
                     f"seed {args.seed}, {src.weights} weights")
        for n in src.notes:
            stdout.print(f"note: {n}")
        stdout.print(f"capture: {res.convention} ids {ids} -> {res.positions_text} "
                     f"(width {len(res.positions)} x {H} = {len(res.positions) * H})")
        for n in res.notes:
            stdout.print(f"note: {n}")
        note = mode_note(mode, args.capture_strategy, len(tokens), L)
        if note:
            stdout.print(f"note: {note}")
        stdout.print(f"tolerance: {report['tolerance_metric']} <= {report['tolerance']:.0e} ({dtype}); "
                     "ranks identical means bitwise equal to the group's rank 0")
        plain = mode.name == "tp"
        stdout.print(table(
            "", ["TP", "ranks", "capture shape per rank", "expected", "ranks identical", "rel err vs TP=1",
                 "logits rel err", "all-reduces (expected)" if plain else "collectives (expected)", "ok"],
            [[str(r["tp"]), str(r["ranks"]), r["shapes"], " ".join(map(str, r["expected_shape"]))
              if isinstance(r["expected_shape"][0], str) else str(r["expected_shape"]),
              {True: "yes", False: "NO", None: "own tokens"}[r["identical"]],
              "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}",
              "-" if r["logits_rel_err"] is None else f"{r['logits_rel_err']:.2e}",
              f"{r['all_reduces']} ({r['expected_all_reduces']})" if plain
              else f"{_ops_text(r['collectives'])} ({_ops_text(r['expected_collectives'])})",
              "ok" if r["ok"] else "FAIL"]
             for r in report["rows"]]))
        for r in report["rows"]:
            if r.get("routing_note"):
                stdout.print(f"note TP={r['tp']}: {r['routing_note']}")
        if report["ok"] and mode.name == "dp-attention":
            stdout.print(f"PASS: each rank's capture is its own tokens x {len(res.positions)} x {H} and equals TP=1 "
                         f"on that rank's sequence at TP {', '.join(map(str, tps))}")
        elif report["ok"]:
            stdout.print(f"PASS: capture is [T, {len(res.positions)} x {H}], all tokens, identical on every rank "
                         f"and equal to TP=1 at TP {', '.join(map(str, tps))}"
                         + ("" if plain else f" (mode {mode.name}, strategy {args.capture_strategy})")
                         + ("; where routing agrees (see the notes)" if any(r.get("routing_note") for r in report["rows"])
                            else ""))
        else:
            for r in report["rows"]:
                for why in r["failures"]:
                    stdout.print(f"FAIL TP={r['tp']}: {why}")
    return 0 if report["ok"] else 1


def summarize(cfg: ModelConfig, res: Resolution, tokens: list[int], dtype: str, tps: list[int],
              rows: list[dict], mode=None) -> dict:
    from tpsim.modes import Mode, expected_collectives
    mode = mode or Mode()
    tol = TOLERANCE[dtype]
    dp = mode.name == "dp-attention"
    width = len(res.positions) * cfg.hidden_size
    out = []
    for tp in tps:
        mine = [r for r in rows if r["tp"] == tp]
        shapes = sorted({json.dumps(r["shape"]) for r in mine})
        errs = [r["rel_err"] for r in mine if r["rel_err"] is not None]
        logit_errs = [r["logits_rel_err"] for r in mine if r.get("logits_rel_err") is not None]
        expected = expected_collectives(mode, cfg, tp)
        traced = [_op_counts(r["collectives"]) for r in mine]
        failures = []
        if dp and tp > 1:  # each rank its own contiguous share of the tokens
            from tpsim.model import split_sizes
            want = {r["rank"]: [n, width] for r, n in zip(sorted(mine, key=lambda r: r["group_rank"]),
                                                         split_sizes(len(tokens), tp))}
            if any(r["shape"] != want[r["rank"]] for r in mine):
                failures.append(f"capture shapes {[r['shape'] for r in mine]} are not each rank's own tokens "
                                f"x {width}")
            expected_shape = [f"[{n}, {width}]" for n in split_sizes(len(tokens), tp)]
        else:
            expected_shape = [len(tokens), width]
            if shapes != [json.dumps(expected_shape)]:
                failures.append(f"capture shapes {', '.join(shapes)} != {expected_shape}")
        if any(r["identical"] is False for r in mine):
            bad = sorted(r["rank"] for r in mine if r["identical"] is False and r["group_rank"] != 0)
            failures.append(f"ranks {bad} differ from their group's rank 0")
        for v in (v for r in mine for v in (r.get("verdicts") or []) if not v["correct"]):
            failures.append(f"{v['position']}: {v['placement']}: {v['reason']}")
        if not all(r["finite"] for r in mine):
            first = next((r for r in mine if not r["finite"] and r.get("first_nonfinite")), None)
            where = "" if first is None else (f"; the first NaN/Inf appeared at {first['first_nonfinite'][0]} "
                                              f"(token {first['first_nonfinite'][1]}) on rank {first['rank']}")
            failures.append(f"the capture holds NaN or Inf{where}")
        rel = max(errs) if errs else None
        if rel is not None and not rel <= tol and all(r["finite"] for r in mine):
            failures.append(f"relative error {rel:.3e} against TP=1 exceeds {tol:.0e}")
        lrel = max(logit_errs) if logit_errs else None
        if lrel is not None and not lrel <= tol:
            failures.append(f"logits relative error {lrel:.3e} against TP=1 exceeds {tol:.0e}")
        if any(t != expected for t in traced):
            got = next(t for t in traced if t != expected)
            failures.append(f"collectives per forward {_ops_text(got)}, expected {_ops_text(expected)} "
                            f"({mode.name} at TP={tp}; tpsim.modes.expected_collectives)")
        counts = sorted({r["all_reduces"] for r in mine})
        flips = [r["routing_flip"] for r in mine if r.get("routing_flip") is not None]
        compared = min((r["compared"] for r in mine if r.get("compared") is not None), default=1.0)
        note = (f"from token {min(flips)} on, some tokens picked other experts than at TP=1 (a routing near-tie "
                f"that {dtype} rounding tipped); the entries it reaches are left out, {compared:.0%} of the "
                "capture is compared") if flips else None
        out.append({"tp": tp, "ranks": len(mine), "routing_note": note,
                    "shapes": " ".join(f"{s} x{sum(json.dumps(r['shape']) == s for r in mine)}" for s in shapes),
                    "expected_shape": expected_shape,
                    "identical": None if dp and tp > 1 else all(r["identical"] for r in mine),
                    "rel_err": rel, "logits_rel_err": lrel,
                    "all_reduces": counts[0] if len(counts) == 1 else counts,
                    "expected_all_reduces": expected.get("all_reduce", 0),
                    "collectives": traced[0] if traced else {}, "expected_collectives": expected,
                    "all_reduce_bytes": mine[0]["all_reduce_bytes"] if mine else 0,
                    "verdicts": next((r["verdicts"] for r in mine if r.get("verdicts")), None),
                    "ok": not failures, "failures": failures})
    return {"model": cfg.to_dict(), "convention": res.to_dict(), "dtype": dtype, "tokens": len(tokens),
            "mode": mode.to_dict(), "tolerance": tol, "tolerance_metric": "||TP=t - TP=1||_F / ||TP=1||_F",
            "rows": out, "ok": all(r["ok"] for r in out), "tpsim_version": __version__}


def _op_counts(collectives) -> dict[str, int]:
    """{op: count} of the model's collectives (check's own comparisons and capture gathers left out)."""
    counts: dict[str, int] = {}
    for op, caller, _ in collectives:
        if not caller.startswith(("check.", "capture.")):
            counts[op] = counts.get(op, 0) + 1
    return counts


OP_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC"}


def _ops_text(counts: dict[str, int]) -> str:
    return " ".join(f"{OP_SHORT.get(op, op)} {n}" for op, n in sorted(counts.items())) or "none"


# --- tpsim capture -----------------------------------------------------------------------

def cmd_capture(args) -> int:
    from tpsim.files.capture import write_capture
    from tpsim.run.ranks import is_reporting_process, run_on_ranks
    from tpsim.ui import ProgressLine
    tp = positive_int(args.tp, "--tp")
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) % tp:
        raise UsageError(f"--tp {tp} does not divide the torchrun world size {os.environ['WORLD_SIZE']}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist; create it first")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name like {out / 'capture.safetensors'}")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"--out {out}: directory {out.parent} is not writable")
    if args.points is not None:
        return capture_points(args, tp, out)
    src, res, tokens = prepare(args, [tp])
    cfg, dtype = src.cfg, dtype_for(args)
    progress = ProgressLine(enabled=is_reporting_process())
    try:
        results = run_on_ranks(capture_job, tp, device=args.device, backend=args.backend,
                               timeout_s=args.timeout, progress=progress, tp=tp, **job_args(src, args, res, tokens))
    finally:
        progress.stop()
    if results is None:
        return 0
    got = sorted((r for r in results.values() if r is not None), key=lambda r: r["group_rank"])
    mode, strategy = args.mode_spec, args.capture_strategy
    if any(r["identical"] is False for r in got):
        print(f"tpsim: error: the capture differs between ranks at TP={tp} (mode {mode.name}, strategy {strategy}); "
              f"nothing written; tpsim check --mode {mode.name} --strategy {strategy} diagnoses it", file=sys.stderr)
        return 1
    placement = "Replicate()"
    if mode.name == "dp-attention" and tp > 1:  # each rank its own sequence: concatenated in rank order
        import torch
        cap = torch.cat([r["capture"] for r in got])
        placement = "Shard(dim=0): rank r's own sequence, rows " + "+".join(str(r["capture"].shape[0]) for r in got)
    else:
        cap = next(r["capture"] for r in got if r["capture"] is not None)
    meta = {"layers": "default" if res.ids is None else ",".join(map(str, res.ids)),
            "convention": res.convention, "positions": res.positions_text, "tp": str(tp), "dtype": dtype,
            "seed": str(args.seed), "config_sha256": cfg.sha256(), "placement": placement,
            "mode": mode.name, "capture_strategy": strategy,
            "weights": src.weights, "tpsim_version": __version__}
    if src.fingerprint:
        meta["checkpoint_fingerprint"] = src.fingerprint
    write_capture(out, cap, tokens, meta)
    for n in src.notes:
        print(f"note: {n}")
    where = (f"{placement}" if placement != "Replicate()"
             else f"identical on all {tp} rank{'s' if tp > 1 else ''}")
    print(f"wrote {out}: aux_hidden_states {list(cap.shape)} ({res.positions_text}), input_ids [{len(tokens)}], "
          f"TP={tp}, mode {mode.name}, {where}")
    return 0


def capture_points(args, tp: int, out: Path) -> int:
    """`capture --points`: each rank's local tensor of each named point, one file per rank."""
    from tpsim.capture.points import check_points
    from tpsim.files.capture import rank_dump_path, write_rank_dump
    from tpsim.run.ranks import check_memory, check_world, is_reporting_process, run_on_ranks
    from tpsim.ui import ProgressLine
    if args.layers is not None:
        raise UsageError("--points and --layers both name what to capture; give one of them")
    src = load_model(args, [tp])
    points = check_points(src.cfg, [p.strip() for p in args.points.split(",") if p.strip()])
    if not points:
        raise UsageError("--points is empty; name points like layers.3.attn.o_proj.partial")
    tokens = tokens_for(args, src.cfg)
    if args.strategy is not None:
        raise UsageError("--strategy applies to --layers captures; --points dumps each rank's local tensors as they are")
    mode = mode_from(args, src.cfg, [tp], len(tokens))[0]
    check_world(tp, args.device, args.force)
    dtype = dtype_for(args)
    check_memory(src.cfg, [tp], dtype, args.device, args.force, str(args.model))
    progress = ProgressLine(enabled=is_reporting_process())
    try:
        results = run_on_ranks(points_job, tp, device=args.device, backend=args.backend,
                               timeout_s=args.timeout, progress=progress, tp=tp, points=points, cfg=src.cfg.to_dict(),
                               seed=args.seed, dtype=dtype, input_ids=tokens, mode=mode.to_dict(),
                               checkpoint=None if src.checkpoint is None else str(src.checkpoint))
    finally:
        progress.stop()
    if results is None:
        return 0
    meta = {"tp": str(tp), "dtype": dtype, "seed": str(args.seed), "config_sha256": src.cfg.sha256(), "mode": mode.name,
            "hidden_size": str(src.cfg.hidden_size), "weights": src.weights, "tpsim_version": __version__}
    ranks = sorted((r for r in results.values() if r is not None), key=lambda r: r["rank"])
    for r in ranks:
        write_rank_dump(out, r["rank"], tp, r["taps"], tokens, meta)
    first = ranks[0]["taps"]
    print(f"wrote {rank_dump_path(out, 0)} .. {rank_dump_path(out, tp - 1).name}: "
          + ", ".join(f"{n} {list(first[n].shape)} {first[n].placement}" for n in points))
    return 0


# --- tpsim export ------------------------------------------------------------------------

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = float("nan")
    if unit not in SIZE_UNITS or not 0 < value * SIZE_UNITS.get(unit, 1) < float("inf"):
        raise UsageError(f"{option} {text!r} is not a size such as 5GB, 500MB or 2GiB")
    return max(1, int(value * SIZE_UNITS[unit]))


def cmd_export(args) -> int:
    import shutil

    from tpsim.checkpoint.export import export_checkpoint, total_bytes
    from tpsim.run.ranks import human_bytes
    from tpsim.ui import progress_bar
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory for the checkpoint")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {out} is not empty; pass --force to replace it, or pick a new directory")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"--out {out}: directory {out.parent} is not writable")
    dtype = "float32" if args.dtype == "auto" else args.dtype
    shard = parse_size(args.max_shard_size, "--max-shard-size")
    cfg = with_overrides(load_model_config(args.model), args.override or [])
    need, free = total_bytes(cfg, getattr(__import__("torch"), dtype)), shutil.disk_usage(out.parent).free
    if need > free:
        raise UsageError(f"the {dtype} checkpoint needs {human_bytes(need)} and {out.parent} has "
                         f"{human_bytes(free)} free; free space, pick another --out or --override num_hidden_layers")
    from tpsim.checkpoint import expected_tensors
    with progress_bar("export", len(expected_tensors(cfg))) as advance:
        files = export_checkpoint(cfg, args.seed, out, dtype, shard, on_tensor=lambda name: advance())
    print(f"wrote {out}: {', '.join(files)} ({human_bytes(need)}, {dtype}, seed {args.seed}, "
          f"{cfg.model_type}, {cfg.num_hidden_layers} layers)")
    return 0


# --- parser ------------------------------------------------------------------------------

def add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="YAML/JSON config with HF DeepseekV2Config fields, a built-in name (tiny, "
                        "deepseek-v2-lite, deepseek-v3), or an HF model directory")
    p.add_argument("--layers", help="layer ids in the convention's numbering, e.g. --layers=-1,2,30 "
                                    "(default: the convention's default ids)")
    p.add_argument("--convention", default="sglang", type=check_convention, metavar="{" + ",".join(CONVENTIONS) + "}")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seq-len", help="number of random tokens drawn from --seed (default 16)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and token seed (default 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, gloo on CPU")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds (default 60)")
    p.add_argument("--force", action="store_true", help="spawn more CPU ranks than the machine should run")
    add_override(p)


def add_mode_options(p: argparse.ArgumentParser, strategy: bool = True) -> None:
    from tpsim.modes import EP_OUTPUTS, MODES
    p.add_argument("--mode", default="tp", metavar="{" + ",".join(MODES) + "}",
                   help="communication mode of the engine replayed (default tp; README: one section per mode)")
    if strategy:
        p.add_argument("--strategy", help="capture strategy (default: the right one for the mode; tp: model-level, "
                                      "ar-fusion: in-layer, sp/ep: gathered, dp-attention: local)")
    p.add_argument("--fusion-max-tokens", help="ar-fusion: fuse the MLP all-reduce into the next layer's norm "
                                               "only for batches of at most this many tokens (default 2048)")
    p.add_argument("--ep-output", metavar="{" + ",".join(EP_OUTPUTS) + "}",
                   help="ep: all-gather the MoE output (replicated, default) or keep the stream token-"
                        "scattered (scattered, DeepEP-style)")


def mode_from(args, cfg: ModelConfig, tps: list[int], tokens: int | None):
    """The Mode the options name and its capture strategy, checked against the config, every
    TP degree and the token count before any rank starts."""
    from tpsim.modes import DEFAULT_FUSION_MAX_TOKENS, Mode
    if args.fusion_max_tokens is not None and args.mode != "ar-fusion":
        raise UsageError(f"--fusion-max-tokens applies to --mode ar-fusion only, not --mode {args.mode}")
    if args.ep_output is not None and args.mode != "ep":
        raise UsageError(f"--ep-output applies to --mode ep only, not --mode {args.mode}")
    fusion = DEFAULT_FUSION_MAX_TOKENS
    if args.fusion_max_tokens is not None:
        try:
            fusion = int(args.fusion_max_tokens)
        except ValueError:
            raise UsageError(f"--fusion-max-tokens {args.fusion_max_tokens!r} is not an integer") from None
    mode = Mode(args.mode, fusion, args.ep_output or "replicated")
    strategy = mode.strategy(getattr(args, "strategy", None))
    for t in tps:
        mode.check(cfg, t, tokens)
    return mode, strategy


def mode_note(mode, strategy: str, tokens: int, L: int) -> str | None:
    """What the mode does to this run's capture, in one line (None for plain tp)."""
    if mode.name == "tp":
        return None
    what = {"ar-fusion": (f"{tokens} tokens <= --fusion-max-tokens {mode.fusion_max_tokens}: the MLP all-reduce of "
                          f"layers 0..{L - 2} runs fused in the next layer's input_layernorm"
                          if tokens <= mode.fusion_max_tokens else
                          f"{tokens} tokens > --fusion-max-tokens {mode.fusion_max_tokens}: no fusion in this "
                          "batch (prefill-sized), every MLP all-reduces in its own layer"),
            "sp": "the residual stream is token-sharded between layers (reduce-scatter / all-gather)",
            "ep": "experts split whole over ranks, tokens moved with all_to_all; the MoE output is "
                  + ("all-gathered" if mode.ep_output == "replicated" else "left token-scattered"),
            "dp-attention": "each rank runs its own sequence (the tokens split in rank order); MLP/MoE "
                            "over all ranks"}[mode.name]
    return f"mode {mode.name}, capture strategy {strategy}: {what}"


def add_override(p: argparse.ArgumentParser) -> None:
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="change one config field, e.g. --override num_hidden_layers=4 (repeatable)")


def build_parser() -> Parser:
    parser = Parser(prog="tpsim", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tpsim {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("check", help="run the model at each TP degree on real ranks and check the capture")
    add_run_options(p)
    add_mode_options(p)
    p.add_argument("--tp", help="TP degrees, e.g. 1,2,4,8 (default 1,2,4,8; under torchrun every divisor "
                                "of the world size)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("capture", help="capture on real ranks and write a safetensors file")
    add_run_options(p)
    add_mode_options(p)
    p.add_argument("--tp", default="1", help="TP degree (default 1)")
    p.add_argument("--tokens", help="token ids, e.g. 1,2,3 (instead of --seq-len)")
    p.add_argument("--out", required=True, help="output .safetensors file (with --points: one file per rank, "
                                                "OUT.rank0.safetensors ...)")
    p.add_argument("--points", help="named points to capture per rank instead of --layers, e.g. "
                                    "layers.3.attn.o_proj.partial,layers.3.mlp.in (tpsim explain lists them)")
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("export", help="write the seeded model as an HF checkpoint (config.json + safetensors)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="YAML/JSON config or built-in name (default tiny)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights seed (default 0)")
    p.add_argument("--out", required=True, help="output directory (created; must be empty unless --force)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights dtype (auto: float32)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file before sharding (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_override(p)
    p.set_defaults(func=cmd_export)

    from tpsim import align, diagnose, explain, scenario, verify
    explain.add_parser(sub, add_run_options)
    align.add_parser(sub)
    diagnose.add_parser(sub)
    scenario.add_parser(sub)
    verify.add_parser(sub)

    p = sub.add_parser("resolve", help="layer ids -> positions, without running a model")
    p.add_argument("--convention", required=True, type=check_convention,
                   metavar="{" + ",".join(CONVENTIONS) + "}")
    p.add_argument("--layers", help="layer ids, e.g. --layers=-1,2,30 (default: the convention's default)")
    p.add_argument("--num-layers", help="num_hidden_layers of the model")
    p.add_argument("--model", help="or read num_hidden_layers from this config")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resolve)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = run_command(argv)
    if under_torchrun():
        from tpsim.parallel.launch import exit_torchrun_rank
        exit_torchrun_rank(code)
    return code


def run_command(argv: list[str] | None) -> int:
    from tpsim.run.ranks import is_reporting_process
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        if is_reporting_process():  # one line, even when a user-given name holds a line break
            one_line = "\\n".join(str(e).splitlines())
            print(f"tpsim: error: {one_line}", file=sys.stderr)
        return 2
    except RankError as e:
        print(f"tpsim: error: {str(e).splitlines()[0]}", file=sys.stderr)
        if os.environ.get("TPSIM_DEBUG"):
            print(str(e), file=sys.stderr)
        return 3
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # raised by a path check, before anything is written
            print(f"tpsim: error: a path is too long ({e.strerror}): {str(e.filename)[:60]}...; use a shorter "
                  "name", file=sys.stderr)
            return 2
        # writing an output failed (disk full, I/O error): the previous file is untouched
        where = f" {e.filename}" if e.filename else ""
        print(f"tpsim: error: could not write the output{where}: {e.strerror or e}; nothing was replaced",
              file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print("tpsim: interrupted", file=sys.stderr)
        return 130
