"""Reading one run's per-rank files and a reference, for `tpsim diagnose`.

Inputs of the command: per-rank tpsim rank dumps (`{stem}.rank{r}.safetensors`,
`format=tpsim-rank-dump`) or SGLang debug-dumper `.pt` files (both layouts below); a reference
that is a tpsim capture file, a TP=1 rank dump, or training features (`aux_hidden_states` /
`hidden_states`, SpecForge's `aux_hidden_state` / `hidden_state`, or a TP=1 SGLang dump's `value`:
`[T, n*H]` or `[1, T, n*H]`, slots named by `--positions` or split by `--hidden-size`).

SGLang's dumper (`python/sglang/srt/debug_utils/dumper.py`), as read in sgl-project/sglang:
- at 5a7255c6: `torch.save(value)` of the bare tensor to
  `sglang_dump_{time}/forward_pass_id={n}___rank={r}___name={name}___dump_index={i}[___k=v...].pt`;
- at 09d99f36: `torch.save({"value": tensor, "meta": {...}})` to
  `sglang_dump_{time}/curr_step={n}___rank={r}___dump_index={i}___name={name}[___k=v...].pt`;
- at 00d35548: the same dict, to
  `{exp_name}/step={n}___rank={r}___dump_index={i}___name={name}___recompute_status=...[___k=v...].pt`.
The dict's meta holds the filename tags, `world_rank`, `world_size` and `sglang_parallel_info`
(`tp_rank`, `tp_size`, ...; only `distributed_error` outside SGLang); the newer dumper's default
non-intrusive mode also dumps the batch's `input_ids` (name `input_ids`).
`rank` is the global rank; `tp_rank` / `tp_size` from the meta win when present. A dump named
`layer_start__hidden_states` with `layer_id=k` is taken to be the residual stream entering
layer k (`hidden_states + residual`, what EAGLE-3 captures): `embed` for k = 0, else out(k-1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from tpsim.capture.positions import Position
from tpsim.errors import UsageError
from tpsim.files.capture import RANK_DUMP_FORMAT
from tpsim.files.safetensors import tensor_sha256

SGLANG_STEP_KEYS = ("step", "forward_pass_id", "curr_step")
SGLANG_BOOKKEEPING = {"rank", "dump_index", "name", "recompute_status", *SGLANG_STEP_KEYS,
                      "pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"}
SGLANG_RESIDUAL_AT_LAYER_START = ("layer_start__hidden_states", "layer_start_hidden_states")
FEATURE_KEYS = ("aux_hidden_states", "aux_hidden_state", "hidden_states", "hidden_state", "value")


@dataclass
class RankSet:
    """One run's per-rank files, validated: `points[p][r]` is rank r's `[rows, w]` tensor."""

    kind: str                          # "tpsim rank dump" | "SGLang dumper"
    files: list[str]                   # rank order (SGLang: one file per rank of the first point)
    tp: int
    points: dict[str, list[torch.Tensor]]
    position: dict[str, str] = field(default_factory=dict)   # point -> position it is (if any)
    declared: dict[str, str] = field(default_factory=dict)   # point -> placement.<point> metadata
    input_ids: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)
    available: list[str] = field(default_factory=list)      # every point name, also those not read


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def open_safetensors(path: Path, keep: set[str] | None = None):
    """(metadata, {name: tensor}, every name) of a safetensors file, every `sha256.<tensor>`
    verified (one tensor at a time; only the names in `keep` are returned, all when None)."""
    if not path.is_file():
        raise UsageError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    tensors, bad = {}, None
    try:
        with safe_open(str(path), "pt") as f:
            meta, names = f.metadata() or {}, list(f.keys())
            for k in names:
                t, want = f.get_tensor(k), meta.get(f"sha256.{k}")
                if want is not None and tensor_sha256(t) != want:
                    bad = k
                    break
                if keep is None or k in keep:
                    tensors[k] = t
    except Exception as e:  # safetensors raises its own error types for a bad header or truncated data
        raise UsageError(f"{path} is not a readable safetensors file ({_short(e)}); pass the file tpsim wrote") from None
    if bad is not None:
        raise UsageError(f"{path}: tensor {bad!r} fails its sha256 checksum (the file is corrupt or was edited); "
                         f"write it again")
    return meta, tensors, names


def expand(files: list[str]) -> list[Path]:
    """The rank files named, a directory standing for its *.safetensors and *.pt files."""
    out = []
    for f in files:
        p = Path(f)
        if p.is_dir():
            found = sorted([*p.glob("*.safetensors"), *p.glob("*.pt")])
            if not found:
                raise UsageError(f"directory {p} holds no *.safetensors or *.pt rank files")
            out += found
        elif not p.exists():
            raise UsageError(f"{p} does not exist; pass one rank file per rank")
        else:
            out.append(p)
    if len(set(out)) != len(out):
        raise UsageError("a rank file is named twice; pass each once")
    return out


def read_rank_files(files: list[str], step: int | None = None, points: list[str] | None = None) -> RankSet:
    """One run's rank files (all points, or only `points` and input_ids)."""
    paths = expand(files)
    pts = [p for p in paths if p.suffix == ".pt"]
    if pts and len(pts) != len(paths):
        raise UsageError("mix of .pt (SGLang dumper) and other rank files; diagnose one run's files of one kind")
    keep = None if not points else {*points, "input_ids"}
    return read_sglang(pts, step, keep) if pts else read_tpsim_dumps(paths, keep)


def _by_rank(items: list[tuple[int, str, object]], tp: int, what: str = "") -> list:
    """(rank, file, item) -> items in rank order 0..tp-1, exactly one per rank."""
    seen: dict[int, tuple[str, object]] = {}
    for rank, name, item in items:
        if rank in seen:
            raise UsageError(f"two files for rank {rank}{what}: {seen[rank][0]} and {name}; pass one per rank")
        seen[rank] = (name, item)
    outside = sorted(r for r in seen if not 0 <= r < tp)
    if outside:
        raise UsageError(f"rank {outside[0]}{what} is outside tp={tp} (ranks 0..{tp - 1}); pass the rank files of "
                         f"one run")
    missing = next((r for r in range(tp) if r not in seen), None)  # lazily: a corrupt tp can be 10**12
    if missing is not None:
        got = ",".join(map(str, sorted(seen)))
        raise UsageError(f"rank {missing} of tp={tp} is missing{what} (got ranks {got}); "
                         f"pass all {tp} rank files of the run")
    return [seen[r][1] for r in range(tp)]


def _int_meta(meta: dict, key: str, path: Path) -> int:
    try:
        return int(meta[key])
    except (KeyError, ValueError):
        raise UsageError(f"{path}: metadata {key!r} is missing or not an integer; not a valid tpsim rank dump") from None


@dataclass
class _Dump:
    path: Path
    meta: dict[str, str]
    rank: int
    tp: int
    tensors: dict[str, torch.Tensor]
    names: list[str]  # every tensor of the file, also those not read


def _read_dump(p: Path, keep: set[str] | None) -> _Dump:
    meta, tensors, names = open_safetensors(p, keep)
    if meta.get("format") != RANK_DUMP_FORMAT:
        raise UsageError(f"{p} is not a tpsim rank dump (format={meta.get('format')!r}); pass the "
                         f"{{stem}}.rank{{r}}.safetensors files of one run")
    d = _Dump(p, meta, _int_meta(meta, "rank", p), _int_meta(meta, "tp", p), tensors, names)
    if not 0 <= d.rank < d.tp:
        raise UsageError(f"{p}: metadata rank={d.rank}, tp={d.tp} is not a rank of a TP group (0 <= rank < tp); "
                         "not a valid tpsim rank dump")
    m = re.search(r"\.rank(\d+)$", p.stem)
    if m and int(m.group(1)) != d.rank:
        raise UsageError(f"{p} is named rank {m.group(1)} but its metadata says rank {d.rank}; rename it")
    if "input_ids" not in tensors:
        raise UsageError(f"{p} has no input_ids; not a valid tpsim rank dump")
    return d


def read_tpsim_dumps(paths: list[Path], keep: set[str] | None = None) -> RankSet:
    """tpsim rank dumps: one file per rank 0..tp-1 of one TP degree, input_ids equal on every rank;
    the points every rank holds, in the writer's order (`points` metadata)."""
    dumps = [_read_dump(p, keep) for p in paths]
    tps = sorted({d.tp for d in dumps})
    if len(tps) > 1:
        raise UsageError(f"the rank files come from different TP degrees (tp={','.join(map(str, tps))}); "
                         f"pass the files of one run")
    dumps = _by_rank([(d.rank, str(d.path), d) for d in dumps], tps[0])
    first, ids = dumps[0], dumps[0].tensors["input_ids"]
    for d in dumps[1:]:
        if not torch.equal(d.tensors["input_ids"], ids):
            raise UsageError(f"{d.path} (rank {d.rank}) holds other input_ids than {first.path} (rank 0): files "
                             f"from different runs; pass the rank files of one run")
    order = [*first.meta.get("points", "").split(","), *first.names]
    everywhere = [n for n in dict.fromkeys(order) if n in first.names and n != "input_ids"
                  and all(n in d.names for d in dumps)]
    read = [n for n in everywhere if n in first.tensors]
    flat = [n for n in read if all(d.tensors[n].dim() != 2 for d in dumps)]
    rs = RankSet("tpsim rank dump", [str(d.path) for d in dumps], tps[0],
                 {n: [d.tensors[n] for d in dumps] for n in read if n not in flat},
                 input_ids=ids.flatten(), available=everywhere)
    for n in rs.points:
        if f"position.{n}" in first.meta:
            rs.position[n] = first.meta[f"position.{n}"]
        if f"placement.{n}" in first.meta:
            rs.declared[n] = first.meta[f"placement.{n}"]
    if flat:
        rs.notes.append(f"skipped points that are not 2-D [rows, width]: {', '.join(flat)}")
    return rs


def sglang_tags(path: Path) -> dict[str, str]:
    """The `k=v` tags of an SGLang dumper file name (`step=0___rank=1___...___name=x.pt`)."""
    tags = {}
    for kv in path.stem.split("___"):
        k, sep, v = kv.partition("=")
        if not sep:
            break
        tags[k] = v
    else:
        if "name" in tags and "rank" in tags and tags["rank"].isdecimal():
            return tags
    raise UsageError(f"{path} is not named like an SGLang dumper file (step=N___rank=R___...___name=X.pt)")


def sglang_point(tags: dict[str, str]) -> str:
    """`name`, plus the non-bookkeeping tags: `layer_start__hidden_states[layer_id=3]`."""
    extra = [f"{k}={v}" for k, v in tags.items() if k not in SGLANG_BOOKKEEPING]
    return tags["name"] + (f"[{','.join(extra)}]" if extra else "")


def sglang_position(tags: dict[str, str]) -> str | None:
    """The residual-stream position an SGLang dump name means (see the module docstring)."""
    lid = tags.get("layer_id")
    if tags["name"] in SGLANG_RESIDUAL_AT_LAYER_START and lid is not None and lid.isdecimal():
        return "embed" if int(lid) == 0 else f"out({int(lid) - 1})"
    return None


def load_pt(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"{path} cannot be read with torch.load(weights_only=True) ({_short(e)}); pass tensor "
                         f"dumps only") from None


def _sglang_rank(tags: dict, obj) -> tuple[int, int | None, torch.Tensor | None]:
    """(TP rank, TP size or None, value) of one loaded dumper file."""
    rank, size, value = int(tags["rank"]), None, obj
    if isinstance(obj, dict) and "value" in obj:
        value, meta = obj["value"], obj.get("meta") or {}
        info = meta.get("sglang_parallel_info") or {}
        if isinstance(info.get("tp_rank"), int) and isinstance(info.get("tp_size"), int):
            rank, size = info["tp_rank"], info["tp_size"]
        elif isinstance(meta.get("world_size"), int):
            size = meta["world_size"]
    return rank, size, value if isinstance(value, torch.Tensor) else None


def read_sglang(paths: list[Path], step: int | None, keep: set[str] | None = None) -> RankSet:
    """SGLang dumper files of one run: point -> per-rank tensors at one step."""
    tagged = [(p, sglang_tags(p)) for p in paths]
    available = sorted({sglang_point(t) for _, t in tagged} - {"input_ids"})
    unknown = sorted((keep or set()) - set(available) - {"input_ids"})
    if unknown:
        raise unknown_point(unknown[0], available)
    tagged = [(p, t) for p, t in tagged if keep is None or sglang_point(t) in keep]
    steps = sorted({next((t[k] for k in SGLANG_STEP_KEYS if k in t), "") for _, t in tagged},
                   key=lambda v: (len(v), v))
    if step is not None:
        tagged = [(p, t) for p, t in tagged if next((t[k] for k in SGLANG_STEP_KEYS if k in t), None) == str(step)]
        if not tagged:
            raise UsageError(f"--step {step}: no dump at that step (steps present: {', '.join(steps)})")
    elif len(steps) > 1:
        raise UsageError(f"the SGLang dumps span steps {', '.join(steps)}; pick one with --step N")
    per_point: dict[str, list] = {}
    sizes, kept = set(), {}
    for p, t in tagged:
        rank, size, value = _sglang_rank(t, load_pt(p))
        sizes.add(size)
        if value is None or value.dim() == 0:
            continue
        per_point.setdefault(sglang_point(t), []).append((rank, str(p), (p, value, t)))
    known = {s for s in sizes if s is not None}
    ranks = {r for items in per_point.values() for r, _, _ in items}
    tp = max(known) if known else (max(ranks) + 1 if ranks else 0)
    if not ranks:
        raise UsageError("the SGLang dump files hold no tensors")
    for name, items in per_point.items():
        kept[name] = _by_rank(items, tp, f" for {name}")
    rs = RankSet("SGLang dumper", [str(v[0]) for v in next(iter(kept.values()))], tp, {}, available=available)
    if not known:
        rs.notes.append(f"the dumps carry no world size; tp={tp} is inferred from the highest rank seen")
    ids = kept.pop("input_ids", None)
    if ids is not None:
        first = ids[0][1].flatten()
        if not all(torch.equal(v[1].flatten(), first) for v in ids):
            raise UsageError("the SGLang input_ids dumps differ between ranks: files from different runs or a "
                             "data-parallel batch; pass one TP group's files of one step")
        rs.input_ids = first
    else:
        rs.notes.append("the SGLang dumps have no input_ids: token order is assumed to match the reference")
    for name, items in kept.items():
        if items[0][1].dim() < 2:
            continue
        rs.points[name] = [v[1].reshape(-1, v[1].shape[-1]) for v in items]
        pos = sglang_position(items[0][2])
        if pos:
            rs.position[name] = pos
    return rs


def unknown_point(p: str, available: list[str]) -> UsageError:
    avail = ", ".join(available[:8]) + (", ..." if len(available) > 8 else "")
    return UsageError(f"--point {p}: no such point in every rank file (points: {avail or 'none'})")


# --- reading the reference -------------------------------------------------------------------

@dataclass
class Reference:
    """Candidates (name -> `[T, W]`) of a reference file; aliases share the tensor object."""

    path: str
    kind: str
    candidates: dict[str, torch.Tensor]
    input_ids: torch.Tensor | None = None


def parse_positions(text: str) -> list[str]:
    try:
        names = [str(Position.parse(p, 1 << 62)) for p in text.split(",")]
    except UsageError as e:
        raise UsageError(f"--positions {text!r}: {e}; write e.g. embed,out(1),out(3)") from None
    if len(set(names)) != len(names):
        raise UsageError(f"--positions {text!r} names a position twice")
    return names


def split_slots(t: torch.Tensor, names: list[str] | None, hidden: int | None, what: str) -> dict[str, torch.Tensor]:
    """`[T, n*H]` -> {slot name: `[T, H]`}, named by `names` or slot0..slot{n-1}."""
    W = t.shape[1]
    if names is None and hidden is None:
        raise UsageError(f"{what} is [{t.shape[0]}, {W}]: name its slots with --positions embed,out(1),... or "
                         f"give --hidden-size H")
    n = len(names) if names is not None else (W // hidden if hidden and W % hidden == 0 else 0)
    if n == 0 or W % n or (hidden is not None and W != n * hidden):
        got = f"{len(names)} positions" if names is not None else "slots"
        raise UsageError(f"{what} is {W} wide, which is not {got} x --hidden-size "
                         f"{hidden if hidden is not None else W // max(n, 1)}; check --positions / --hidden-size")
    names = names if names is not None else [f"slot{i}" for i in range(n)]
    return {name: c.contiguous() for name, c in zip(names, t.split(W // n, dim=1))}


def _as_2d(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise UsageError(f"{what} is {list(t.shape)}; expected [T, n*hidden] or [1, T, n*hidden]")
    return t


def read_reference(path_text: str, positions: list[str] | None, hidden: int | None) -> Reference:
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--reference {path} does not exist" if not path.exists() else f"--reference {path} is not a file")
    if path.suffix == ".safetensors":
        meta, tensors, _ = open_safetensors(path)
    else:
        obj = load_pt(path)
        meta, tensors = {}, (obj if isinstance(obj, dict) else {"hidden_states": obj})
        tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    ids = tensors.get("input_ids")
    ids = ids.flatten() if ids is not None else None
    if meta.get("format") == RANK_DUMP_FORMAT:
        if meta.get("tp") != "1":
            raise UsageError(f"--reference {path} is a tp={meta.get('tp')} rank dump; a reference rank dump must be "
                             f"TP=1 (every point whole)")
        cands = {n: t for n, t in tensors.items() if n != "input_ids" and t.dim() == 2}
        cands.update({meta[f"position.{n}"]: t for n, t in list(cands.items()) if f"position.{n}" in meta})
        return Reference(str(path), "TP=1 rank dump", cands, ids)
    key = next((k for k in FEATURE_KEYS if k in tensors), None)
    if key is None:
        raise UsageError(f"--reference {path} holds no aux_hidden_states / hidden_states tensor (found: "
                         f"{', '.join(tensors) or 'nothing'}); pass a capture, a TP=1 rank dump or features")
    t = _as_2d(tensors[key], f"--reference {path}: {key}")
    if "positions" in meta:
        own = [p.strip() for p in meta["positions"].split(",")]
        if positions is not None and positions != own:
            raise UsageError(f"--positions {','.join(positions)} differs from the capture's own positions "
                             f"{','.join(own)}; drop --positions")
        return Reference(str(path), "capture file", split_slots(t, own, hidden, f"--reference {path}"), ids)
    return Reference(str(path), "training features", split_slots(t, positions, hidden, f"--reference {path}: {key}"),
                     ids)


