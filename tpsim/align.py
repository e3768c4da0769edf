"""`tpsim align`: does the trainer of an EAGLE-3 draft capture the same residual-stream positions,
in the same slot order, as the server that runs it?

Each side is a convention and its ids, given as `--train CONVENTION:IDS --serve CONVENTION:IDS`,
or read from the draft's config.json the way each program reads it (`--draft-config PATH
--trainer specforge --server sglang|sglang-boundary|vllm`). Slot i of a side is the i-th feature
its capture concatenates (list order for specforge/hf, ascending and each position once for the
loop-order engines). Aligned means every slot holds the same position and both sides have the
same number of slots. With `--model` the model also runs once (at `--tp`) and each slot gets the
cosine between the feature training saw and the one the server captures.

Exit 0 aligned, 1 not aligned, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from tpsim.capture import Position, check_convention, default_ids, ids_for, resolve
from tpsim.cli import add_override, emit_json, positive_int, seed_value
from tpsim.errors import UsageError
from tpsim.run.jobs import capture_job

LOOP_ORDER = ("sglang", "sglang-boundary", "vllm", "eagle")  # `if i in layers`: ascending, each once
KEY = "eagle_aux_hidden_state_layer_ids"
NESTED = f"eagle_config.{KEY}"
TOP = f"top-level {KEY}"
TRAINERS = ("specforge",)
SERVERS = ("sglang", "sglang-boundary", "vllm")
LABELS = {  # reason code -> the words the table uses
    "off-by-one": "off by one",
    "embed-never-trained": "embedding slot never seen in training",
    "default-fallback": "default fallback",
    "unreachable": "unreachable layer",
    "order": "different concatenation order",
    "slot-count": "different number of slots",
    "post-norm": "final-norm output vs pre-norm residual",
    "different-layer": "different layer",
}


# --- the two sides ------------------------------------------------------------------------

@dataclass
class Capture:
    """One slot of one side: the id as written and the position it captures (None when the
    convention cannot reach it; `error` is resolve's message)."""

    id: int
    position: Position | None
    error: str | None = None


@dataclass
class Side:
    """What one program captures: its slots in concatenation order and where its ids came from."""

    role: str  # "train" | "serve"
    convention: str
    num_layers: int
    ids: list[int]  # the ids in effect, as written (a default filled in)
    default: bool
    source: str
    slots: list[Capture]
    notes: list[str] = field(default_factory=list)
    fallback: str | None = None  # why a draft-config reader used the default

    @property
    def positions(self) -> list[Position | None]:
        return [c.position for c in self.slots]

    @property
    def resolved(self) -> bool:
        return all(p is not None for p in self.positions)

    @property
    def order(self) -> str:
        return "ascending, each position once" if self.convention in LOOP_ORDER else "list order"

    def ids_text(self) -> str:
        return ("default " if self.default else "") + ",".join(map(str, self.ids))

    def to_dict(self) -> dict:
        return {"role": self.role, "convention": self.convention, "ids": self.ids, "default": self.default,
                "source": self.source, "fallback": self.fallback, "order": self.order,
                "slot_ids": [c.id for c in self.slots], "positions": [_pos(c.position) for c in self.slots],
                "unreachable": [{"id": c.id, "error": c.error} for c in self.slots if c.error],
                "notes": self.notes}


def _pos(p: Position | None) -> str | None:
    return None if p is None else str(p)


def _capture(conv: str, ids: list[int], i: int, L: int) -> Capture:
    """Where ids[i] lands in `conv` as part of `ids` (sglang-boundary's +1 depends on the first id)."""
    j = ids[i]
    try:
        if conv != "sglang-boundary" or i == 0:
            return Capture(j, resolve(conv, [j], L).positions[0])
        if ids[0] == 1 and L < 3:  # the first id is itself unreachable; the +1 still applies
            return Capture(j, resolve("sglang", [j], L).positions[0])
        return Capture(j, Position.at_boundary(resolve(conv, [1 if ids[0] == 1 else 0, j], L).internal[1]))
    except UsageError as e:
        return Capture(j, None, str(e))


def make_side(role: str, convention: str, ids: list[int] | None, L: int, source: str = "given",
              fallback: str | None = None) -> Side:
    """A side from ids (None: the convention's default ids). Unreachable ids stay as slots with an
    error; the loop-order engines sort by id (monotone in position) and keep a repeated id once."""
    conv = check_convention(convention)
    if ids is None:
        return _default_side(role, conv, L, source, fallback)
    if not ids:
        raise UsageError(f"{role} ids are empty; give at least one id or 'default'")
    caps = [_capture(conv, ids, i, L) for i in range(len(ids))]
    if conv in LOOP_ORDER:
        caps = list({c.id: c for c in sorted(caps, key=lambda c: c.id)}.values())
    side = Side(role, conv, L, list(ids), False, source, caps, fallback=fallback)
    if side.resolved:
        side.notes = resolve(conv, ids, L).notes
    return side


def _default_side(role: str, conv: str, L: int, source: str, fallback: str | None) -> Side:
    if conv == "hf":
        raise UsageError(f"hf has no default ids; write --{role} hf:IDS, e.g. --{role} hf:2,{L // 2},{L - 3}")
    ids = default_ids(conv, L)
    try:
        res = resolve(conv, None, L)
    except UsageError as e:
        raise UsageError(f"the {conv} default ids {ids} do not fit {L} layers ({e}); give ids instead") from None
    order = sorted(set(ids)) if conv in LOOP_ORDER else ids
    caps = [Capture(j, p) for j, p in zip(order, res.positions)]
    return Side(role, conv, L, ids, True, source, caps, res.notes, fallback)


# --- comparing them -----------------------------------------------------------------------

@dataclass
class Reason:
    """Why a slot (or the whole pair) does not line up: a code from LABELS and the specifics."""

    code: str
    text: str

    def __str__(self) -> str:
        return f"{LABELS[self.code]}: {self.text}"

    def to_dict(self) -> dict:
        return {"code": self.code, "label": LABELS[self.code], "text": self.text}


@dataclass
class Slot:
    """Slot `index` of both captures (None: that side has fewer slots)."""

    index: int
    train: Capture | None
    serve: Capture | None
    reasons: list[Reason] = field(default_factory=list)
    cosine: float | None = None

    @property
    def match(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        t, s = self.train, self.serve
        return {"slot": self.index, "train_id": t and t.id, "train_position": t and _pos(t.position),
                "serve_id": s and s.id, "serve_position": s and _pos(s.position), "match": self.match,
                "reasons": [r.to_dict() for r in self.reasons], "cosine": self.cosine}


@dataclass
class Fix:
    """The server ids that capture the trained positions in the trained order (None: there are
    none, `text` says why)."""

    ids: list[int] | None
    text: str
    slot_ids: dict[Position, int] = field(default_factory=dict)


@dataclass
class Report:
    """Both sides slot by slot, the server fix when they differ, and the --model run if any."""

    train: Side
    serve: Side
    slots: list[Slot]
    fix: Fix | None
    notes: list[str] = field(default_factory=list)
    run: dict | None = None

    @property
    def aligned(self) -> bool:
        return all(s.match for s in self.slots)

    @property
    def reasons(self) -> list[Reason]:
        """Each reason code once, with the slots it holds for."""
        seen: dict[str, list[int]] = {}
        for s in self.slots:
            for r in s.reasons:
                seen.setdefault(r.code, []).append(s.index)
        fell_back = " and ".join(s.role for s in (self.train, self.serve) if s.fallback)
        return [Reason(code, f"{fell_back} ids" if code == "default-fallback" else
                       f"slot{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}") for code, ix in seen.items()]

    def to_dict(self) -> dict:
        return {"aligned": self.aligned, "num_layers": self.train.num_layers,
                "train": self.train.to_dict(), "serve": self.serve.to_dict(),
                "slots": [s.to_dict() for s in self.slots],
                "reasons": [{**r.to_dict(), "slots": [s.index for s in self.slots if r.code in codes(s)]}
                            for r in self.reasons],
                "fix": None if self.fix is None else {"convention": self.serve.convention, "ids": self.fix.ids,
                                                      "text": self.fix.text},
                "notes": self.notes, "run": self.run}


def codes(slot: Slot) -> list[str]:
    """The reason codes of one slot."""
    return [r.code for r in slot.reasons]


def align(train: Side, serve: Side) -> Report:
    """Compare the two captures slot by slot."""
    if train.num_layers != serve.num_layers:
        raise ValueError("both sides must be resolved on the same number of layers")
    n = max(len(train.slots), len(serve.slots))
    slots = [Slot(i, _at(train.slots, i), _at(serve.slots, i)) for i in range(n)]
    fix = serve_fix(train, serve)
    reordered = _reordered(train, serve)
    for s in slots:
        s.reasons = _slot_reasons(s, train, serve, reordered, fix)
    report = Report(train, serve, slots, None if all(s.match for s in slots) else fix)
    report.notes = _fallback_notes(report)
    return report


def _at(items: list, i: int):
    return items[i] if i < len(items) else None


def _reordered(train: Side, serve: Side) -> bool:
    """The same positions (with multiplicity) in a different order."""
    t, s = train.positions, serve.positions
    if t == s or len(t) != len(s) or not (train.resolved and serve.resolved):
        return False
    return sorted(t, key=Position.sort_key) == sorted(s, key=Position.sort_key)


def _slot_reasons(slot: Slot, train: Side, serve: Side, reordered: bool, fix: Fix) -> list[Reason]:
    t, s = slot.train, slot.serve
    out = [Reason("unreachable", f"{side.role} {side.convention} id {c.id}: {c.error}")
           for side, c in ((train, t), (serve, s)) if c is not None and c.position is None]
    if t is None or s is None:
        lack = train if t is None else serve
        out.append(Reason("slot-count", f"{lack.role} has no slot {slot.index}: training concatenates "
                                        f"{len(train.slots)} features ({train.convention}), serving "
                                        f"{len(serve.slots)} ({serve.convention})"))
    elif not out and t.position != s.position:
        out = _position_reasons(slot.index, t.position, s.position, train, serve, reordered, fix)
    return out + _fallbacks(train, serve) if out else out


def _position_reasons(i: int, tp: Position, sp: Position, train: Side, serve: Side, reordered: bool,
                      fix: Fix) -> list[Reason]:
    if reordered:
        k = train.positions.index(sp)
        return [Reason("order", f"serve {sp} is train slot {k}: the same positions, {train.convention} "
                                f"concatenates in {train.order}, {serve.convention} {serve.order}")]
    out = []
    if sp.kind == "embed" and tp.kind != "embed":
        out.append(Reason("embed-never-trained", f"serve captures embed in slot {i}, where training saw {tp}"))
    hint = f"; {serve.convention} id {fix.slot_ids[tp]} captures {tp}" if tp in fix.slot_ids else ""
    if "final" in (tp.kind, sp.kind):
        out.append(Reason("post-norm", f"train {tp}, serve {sp}: final is the final-norm output, "
                                       f"the rest are pre-norm residual sums{hint}"))
    elif abs(sp.boundary - tp.boundary) == 1:
        where = "after" if sp.boundary > tp.boundary else "before"
        out.append(Reason("off-by-one", f"serve {sp} is one layer {where} train {tp}{hint}"))
    else:
        out.append(Reason("different-layer", f"train {tp}, serve {sp} ({abs(sp.boundary - tp.boundary)} "
                                             f"layers apart){hint}"))
    return out


def _fallbacks(train: Side, serve: Side) -> list[Reason]:
    return [Reason("default-fallback", side.fallback) for side in (train, serve) if side.fallback]


def _fallback_notes(report: Report) -> list[str]:
    outcome = ("the default happens to select the trained positions, so this works by coincidence"
               if report.aligned else "the default does not select the trained positions")
    return [f"{side.role}: {side.fallback}; {outcome}" for side in (report.train, report.serve) if side.fallback]


def serve_fix(train: Side, serve: Side) -> Fix:
    """The ids the server should use: the trained positions, in the trained order."""
    L, conv, want = train.num_layers, serve.convention, train.positions
    if not train.resolved:
        return Fix(None, "training itself names an unreachable id; fix the training ids first")
    try:
        ids = ids_for(conv, want, L)
        got = resolve(conv, ids, L).positions
    except UsageError as e:
        return Fix(None, f"no {conv} ids capture {_ptext(want)}: {e}")
    if got != want:
        return Fix(None, f"no {conv} ids capture {_ptext(want)} in this order: {conv} concatenates "
                         f"{serve.order}; retrain with ids in ascending order, each once")
    fixed = make_side("serve", conv, ids, L)
    return Fix(ids, f"serve with {conv} ids {','.join(map(str, ids))}",
               {c.position: c.id for c in fixed.slots})


def _ptext(positions) -> str:
    return ", ".join("unreachable" if p is None else str(p) for p in positions)


# --- draft config.json --------------------------------------------------------------------

@dataclass
class DraftConfig:
    """The two places a draft config.json can hold the aux layer ids (None: absent or null)."""

    path: Path
    nested: list[int] | None
    top: list[int] | None


def read_draft_config(text: str) -> DraftConfig:
    """Read and type-check --draft-config (a config.json, or a directory holding one)."""
    p = Path(text)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"  # a FIFO would block the read
        raise UsageError(f"--draft-config {p} {what}; give the draft model's config.json or its directory")
    try:
        raw = json.loads(p.read_text())
    except UnicodeDecodeError:
        raise UsageError(f"--draft-config {p} is not a text file (binary data, not JSON); give the draft's "
                         "config.json") from None
    except OSError as e:
        raise UsageError(f"--draft-config {p}: cannot read it ({e.strerror or e.__class__.__name__}); check the "
                         "path") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--draft-config {p} is not valid JSON ({e.msg} at line {e.lineno}); "
                         "give the draft's config.json") from None
    except RecursionError:
        raise UsageError(f"--draft-config {p} is not a config.json (JSON nested too deeply to read); "
                         "give the draft's config.json") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--draft-config {p} holds a JSON {type(raw).__name__}, not an object; give the draft's config.json")
    eagle = raw.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise UsageError(f"--draft-config {p}: eagle_config is a {type(eagle).__name__}, not an object; "
                         f'write "eagle_config": {{"{KEY}": [1, 29, 57]}}')
    nested = _ids_at(p, NESTED, (eagle or {}).get(KEY))
    if nested == []:
        raise UsageError(f"--draft-config {p}: {NESTED} is empty; SpecForge validates exactly three ids: "
                         "write them (e.g. [1, 29, 57]) or remove the key for the default")
    return DraftConfig(p, nested, _ids_at(p, TOP, raw.get(KEY)))


def _ids_at(p: Path, where: str, value) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in value):
        raise UsageError(f"--draft-config {p}: {where} is {json.dumps(value)}, not a list of integer "
                         "layer ids; write e.g. [1, 29, 57]")
    return value


def side_from_config(role: str, program: str, draft: DraftConfig, L: int) -> Side:
    """The ids `program` reads from the draft config: vLLM only the top-level key (skipping an empty
    list), SpecForge and SGLang only the key nested under eagle_config; else its default."""
    top = program == "vllm"
    here, other = (draft.top, draft.nested) if top else (draft.nested, draft.top)
    where = TOP if top else NESTED
    if here:
        return make_side(role, program, here, L, f"{draft.path}: {where}")
    if here == []:
        why = f"{program} reads only the top-level key and skips an empty list"
    elif other and top:
        why = f"{program} reads only the top-level key, this config has it nested under eagle_config"
    elif other:
        why = f"{program} reads only the key nested under eagle_config, this config has it at the top level"
    else:
        why = f"{program} reads only {where}, and this config has neither key"
    ids = default_ids(program, L)
    fallback = f"default fallback: {why}; {program} uses its default {ids}"
    if program == "specforge":
        fallback += " (unless the training run overrode the ids)"
    return make_side(role, program, None, L, f"{draft.path}: default fallback", fallback)


# --- the command --------------------------------------------------------------------------

def parse_spec(text: str, option: str) -> tuple[str, list[int] | None]:
    """`CONVENTION:IDS` -> (convention, ids or None for `default`)."""
    name, colon, ids = text.partition(":")
    example = f"{option} specforge:1,29,57 or {option} sglang:default"
    if not colon:
        raise UsageError(f"{option} {text!r} has no ':'; write CONVENTION:IDS, e.g. {example}")
    try:
        conv = check_convention(name.strip())
    except UsageError as e:
        raise UsageError(f"{option}: {e}") from None
    if ids.strip() == "default":
        return conv, None
    try:
        return conv, [int(x) for x in ids.split(",")]
    except ValueError:
        raise UsageError(f"{option} {text!r}: {ids!r} is not a comma-separated list of integers or 'default'; "
                         f"e.g. {example} (negative ids are fine: sglang:-1,2,30)") from None


def check_inputs(args) -> None:
    """Exactly one input style, complete; a layer count from exactly one place."""
    by_ids = args.train is not None or args.serve is not None
    by_config = any(v is not None for v in (args.draft_config, args.trainer, args.server))
    if by_ids and by_config:
        raise UsageError("give either --train/--serve or --draft-config/--trainer/--server, not both")
    if not by_ids and not by_config:
        raise UsageError("nothing to align: give --train CONVENTION:IDS --serve CONVENTION:IDS, or "
                         "--draft-config PATH --server sglang|sglang-boundary|vllm")
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
        raise UsageError("--trainer/--server read a draft config: give --draft-config PATH (the draft's config.json)")
    if args.server is None:
        raise UsageError(f"--draft-config needs --server, one of {', '.join(SERVERS)}")
    if args.server not in SERVERS:
        raise UsageError(f"unknown server {args.server!r}; use one of {', '.join(SERVERS)} (or compare any "
                         "convention with --train/--serve)")
    if (args.trainer or "specforge") not in TRAINERS:
        raise UsageError(f"unknown trainer {args.trainer!r}; use specforge (or compare any convention with "
                         "--train/--serve)")


def sides(args, L: int) -> tuple[Side, Side]:
    if args.draft_config is None:
        out = []
        for role, text in (("train", args.train), ("serve", args.serve)):
            conv, ids = parse_spec(text, f"--{role}")
            out.append(make_side(role, conv, ids, L, f"--{role} {text}"))
        return out[0], out[1]
    draft = read_draft_config(args.draft_config)
    return (side_from_config("train", args.trainer or "specforge", draft, L),
            side_from_config("serve", args.server, draft, L))


def fix_hint(report: Report, by_config: bool) -> str:
    ids = report.fix.ids
    if not by_config:
        return f"--serve {report.serve.convention}:{','.join(map(str, ids))}"
    if report.serve.convention == "vllm":
        return f'top level of the draft config: "{KEY}": {json.dumps(ids)}'
    return (f'draft config "eagle_config": {{"{KEY}": {json.dumps(ids)}}}; SpecForge reads the same key, '
            "so keep the trained ids on record")


def cmd_align(args) -> int:
    from tpsim.cli import load_model
    from tpsim.run.ranks import is_reporting_process
    check_inputs(args)
    src, tp = None, positive_int(args.tp, "--tp")
    if args.model is not None:
        _check_timeout(args.timeout)
        src = load_model(args, [tp])
        L = src.cfg.num_hidden_layers
    else:
        L = positive_int(args.num_layers, "--num-layers")
    report = align(*sides(args, L))
    if src is not None:
        report.run = run_model(args, src, tp, report)
        if not is_reporting_process():
            return 0
    if report.fix is not None and report.fix.ids is not None:
        report.fix.text += f" ({fix_hint(report, args.draft_config is not None)})"
    if args.json:
        emit_json(report.to_dict())
    else:
        print_report(report, args)
    return 0 if report.aligned else 1


def _check_timeout(t: float) -> None:
    if not 0 < t < timedelta.max.total_seconds():
        raise UsageError(f"--timeout {t:g} must be a positive, finite number of seconds, e.g. 60")


# --- running the model --------------------------------------------------------------------

def run_model(args, src, tp: int, report: Report) -> dict | None:
    """Capture every position either side names once, at TP=`tp`, and set each slot's cosine
    (mean over tokens) between the feature training saw and the one the server captures."""
    from types import SimpleNamespace

    from tpsim.cli import dtype_for, job_args, tokens_for
    from tpsim.parallel.launch import under_torchrun
    from tpsim.run.ranks import check_memory, check_world, is_reporting_process, run_on_ranks
    from tpsim.ui import ProgressLine
    tokens = tokens_for(args, src.cfg)
    check_world(tp, args.device, args.force)
    check_memory(src.cfg, [tp], dtype_for(args), args.device, args.force, str(args.model))
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) % tp:
        raise UsageError(f"--tp {tp} does not divide the torchrun world size {os.environ['WORLD_SIZE']}")
    union = sorted({p for side in (report.train, report.serve) for p in side.positions if p is not None},
                   key=Position.sort_key)
    info = {"model": args.model, "weights": src.weights, "checkpoint_fingerprint": src.fingerprint,
            "tp": tp, "dtype": dtype_for(args), "seed": args.seed, "tokens": len(tokens),
            "positions": [str(p) for p in union], "notes": src.notes}
    if not union:
        return info
    progress = ProgressLine(enabled=is_reporting_process())
    try:
        results = run_on_ranks(capture_job, tp, device=args.device, backend=args.backend,
                               timeout_s=args.timeout, progress=progress, tp=tp,
                               **job_args(src, args, SimpleNamespace(positions=union), tokens))
    finally:
        progress.stop()
    if results is None:
        return None
    got = [r for r in results.values() if r is not None]
    cap = next(r["capture"] for r in got if r["capture"] is not None)
    info["identical_on_ranks"] = all(r["identical"] for r in got)
    set_cosines(report.slots, cap, union, src.cfg.hidden_size)
    return info


def set_cosines(slots: list[Slot], cap, union: list[Position], H: int) -> None:
    """cos(train feature, serve feature) per token, averaged, in float64, for every slot both
    sides reach."""
    import torch.nn.functional as F
    for s in slots:
        if s.train is None or s.serve is None or s.train.position is None or s.serve.position is None:
            continue
        a, b = (cap[:, k * H:(k + 1) * H].double() for k in
                (union.index(s.train.position), union.index(s.serve.position)))
        s.cosine = float(F.cosine_similarity(a, b, dim=-1).mean())


# --- output -------------------------------------------------------------------------------

def print_report(report: Report, args) -> None:
    from rich.markup import escape

    from tpsim.ui import stdout, table

    def say(text: str) -> None:  # one line however long, so it can be grepped
        stdout.print(text, soft_wrap=True, markup=False)
    train, serve = report.train, report.serve
    say(f"tpsim align: train {train.convention} vs serve {serve.convention} on {train.num_layers} layers")
    for side in (train, serve):
        say(f"{side.role}: {side.convention} ids {side.ids_text()} (from {side.source}) -> "
            f"{_ptext(side.positions)} ({side.order})")
        for n in side.notes:
            say(f"note: {side.role}: {n}")
    if report.run is not None:
        r = report.run
        say(f"run: {args.model}, {r['weights']} weights, TP={r['tp']}, {r['dtype']}, {r['tokens']} tokens, "
            f"seed {r['seed']}; cosine = mean over tokens of cos(train feature, serve feature)")
        for n in r["notes"]:
            say(f"note: {n}")
    run = report.run is not None
    columns = ["slot", "train id", "train position", "serve id", "serve position", "match"]
    stdout.print(table("", columns + (["cosine"] if run else []) + ["reason"],
                       [[escape(c) for c in _row(s, run)] for s in report.slots]))
    for n in report.notes:
        say(f"note: {n}")
    if report.aligned:
        say(f"ALIGNED: {len(report.slots)} slots, the same positions in the same order "
            f"({_ptext(train.positions)})")
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
    return row + ["; ".join(map(str, s.reasons))]


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="do trainer and server capture the same positions in the same slot order?")
    p.add_argument("--train", metavar="CONVENTION:IDS", help="training side, e.g. specforge:1,29,57 or specforge:default")
    p.add_argument("--serve", metavar="CONVENTION:IDS", help="serving side, e.g. sglang:-1,2,30 or vllm:default")
    p.add_argument("--draft-config", metavar="PATH", help="or read the ids from the draft's config.json as each program does")
    p.add_argument("--trainer", metavar="{" + ",".join(TRAINERS) + "}", help="with --draft-config (default specforge)")
    p.add_argument("--server", metavar="{" + ",".join(SERVERS) + "}", help="with --draft-config")
    p.add_argument("--num-layers", help="num_hidden_layers of the target model")
    p.add_argument("--model", help="or the target model (config or HF directory): also runs it and reports the "
                                   "cosine per slot")
    add_override(p)
    p.add_argument("--tp", default="1", help="TP degree of the --model run (default 1)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seq-len", default="16", help="number of random tokens drawn from --seed (default 16)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and token seed (default 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, gloo on CPU")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds (default 60)")
    p.add_argument("--force", action="store_true", help="spawn more CPU ranks than the machine should run")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_align)

