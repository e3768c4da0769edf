"""`tpsim diagnose`: what did each rank of a TP group actually capture?

Given one run's per-rank tensors of a point (`ranks[r]`: `[rows_r, w_r]`, rank order) and a
reference (candidate name -> full tensor `[T, W]`), every placement hypothesis is tried against
every candidate:

| placement       | shapes it needs                                  | full tensor it implies       |
|-----------------|--------------------------------------------------|------------------------------|
| `Replicate()`   | every rank `[T, W]`                              | each rank (diff: the worst)  |
| `Partial(sum)`  | every rank `[T, W]`, tp > 1                      | sum over ranks (float64)     |
| `Shard(dim=0)`  | every rank `[rows_r, W]`, sum of rows_r = T      | concatenation along dim 0    |
| `Shard(dim=-1)` | every rank `[T, w_r]`, sum of w_r = W (or equal  | concatenation along dim -1   |
|                 | widths padded past W, e.g. a padded vocab)       | (first W columns)            |

The best (placement, candidate) pair within the threshold is the verdict: `Replicate()` of the
asked candidate is correct; another candidate is the wrong position ("this is out(1), you asked
for out(2)"); nothing within the threshold is `unexplained` (the closest pair is reported).
At tp = 1 a lone rank can only be `Replicate()`.

Similarity is DeepGEMM's / SGLang's `calc_diff(x, y) = 1 - 2*sum(x*y) / sum(x*x + y*y)` in
float64: 0 for identical tensors, (1-c)^2/(1+c^2) for y = c*x, 1 against zeros, 2 for y = -x.
A pair matches when `calc_diff <= 1e-5` if both sides are float32/float64, `<= 1e-3` if either
side is bfloat16/float16 (why: the comment on `THRESHOLDS`).

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

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tpsim.errors import UsageError
from tpsim.parallel.placement import P, R, S0, S1, Placement

UNEXPLAINED = "unexplained"
PLACEMENTS = (R, S0, S1, P)  # tie-break order

# calc_diff thresholds (calc_diff ~ rel_err^2 / 2 for rel_err = ||x - y|| / ||y||).
# float32 on both sides: TP round-off gives ~1e-13 (measured <= 9.2e-14 over 400 runs of up to 4
# layers, TP 2/4/8 vs TP 1; transformers parity rel_err <= 7.1e-7 gives 2.5e-13). 1e-5 is eight
# orders above that, still admits a float32 reference from another implementation (TF32 GEMMs:
# rel_err ~4e-3 gives ~1e-5), and stays 1000x below a wrong tensor.
# bfloat16/float16 on either side: TP round-off is ~1e-2 relative error, calc_diff ~5e-5
# (measured <= 6.9e-5; tpsim's bf16 bound rel_err 3e-2 gives 4.5e-4). 1e-3 (also SGLang
# dump_comparator's default --diff-threshold) is above both and 10x below a wrong tensor.
# A wrong tensor: another layer or a per-rank partial sum gives >= 1e-2 (tp=2 equal halves: 0.2;
# adjacent residual-stream layers of a deep model: cosine 0.99 and a few % norm growth, ~1e-2).
THRESHOLDS = {"exact": 1e-5, "low_precision": 1e-3}
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Verdict:
    point: str              # the asked tensor's name (e.g. "layers.3.attn.o_proj.partial" or "out(2)")
    placement: Placement | str  # a Placement, or UNEXPLAINED
    matches: str | None     # the reference candidate it matches (None when unexplained)
    correct: bool           # Replicate() and matches == the asked name
    diff: float             # calc_diff of the best match
    reason: str             # one line for humans


def calc_diff(x, y) -> float:
    """`1 - 2*sum(x*y) / sum(x^2 + y^2)` in float64 (DeepGEMM, SGLang): 0 = identical; 0 for two
    all-zero tensors; NaN when either holds NaN/Inf. Shapes must be equal."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes {list(x.shape)} and {list(y.shape)} differ")
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    if denom == 0:
        return 0.0
    return 1.0 - 2.0 * (x * y).sum().item() / denom


def match_threshold(*dtypes: torch.dtype) -> float:
    """1e-3 when any side is bfloat16/float16, else 1e-5 (see THRESHOLDS)."""
    return THRESHOLDS["low_precision" if any(d in LOW_PRECISION for d in dtypes) else "exact"]


def identical(ranks: list[torch.Tensor]) -> bool:
    """Every rank bitwise equal to rank 0."""
    return all(r.shape == ranks[0].shape and r.dtype == ranks[0].dtype and torch.equal(r, ranks[0]) for r in ranks)


# --- placements ----------------------------------------------------------------------------

def _implied(ranks: list[torch.Tensor], T: int, W: int) -> list[tuple[str, list[torch.Tensor], str]]:
    """(placement, the float64 tensors that must each equal the candidate, detail) for every
    placement whose shapes fit a candidate `[T, W]`."""
    tp, shapes = len(ranks), [tuple(r.shape) for r in ranks]
    f64 = [r.double() for r in ranks]
    out = []
    if all(s == (T, W) for s in shapes):
        out.append((R, f64, ""))
        if tp > 1:
            out.append((P, [torch.stack(f64).sum(0)], ""))
    if tp > 1 and all(s[1] == W for s in shapes) and sum(s[0] for s in shapes) == T:
        out.append((S0, [torch.cat(f64, 0)], "+".join(str(s[0]) for s in shapes)))
    widths = [s[1] for s in shapes]
    if tp > 1 and all(s[0] == T for s in shapes):
        if sum(widths) == W:
            out.append((S1, [torch.cat(f64, -1)], ""))
        elif sum(widths) > W > widths[0] and len(set(widths)) == 1:  # narrower shards, padded at the end
            out.append((S1, [torch.cat(f64, -1)[:, :W]], f"padded:{sum(widths) - W}"))
    return out


def _tries(ranks, reference, residual=None):
    """(diff, placement, candidate, detail, threshold) of every fitting pair."""
    out, cache = [], {}
    for name, ref in reference.items():
        if ref.dim() != 2:
            continue
        key = tuple(ref.shape)
        if key not in cache:
            cache[key] = _implied(ranks, *key)
        thr = match_threshold(ref.dtype, *(r.dtype for r in ranks))
        for placement, fulls, detail in cache[key]:
            diff = max(calc_diff(f, ref) for f in fulls)
            out.append((diff, placement, name, detail, thr))
        res = (residual or {}).get(name)
        if res is not None and len(ranks) > 1 and all(tuple(r.shape) == key for r in ranks) \
                and tuple(res.shape) == key:
            # hidden + residual with hidden Partial(sum), residual Replicate(): the ranks sum to
            # full hidden + tp * residual, so the candidate is that sum minus (tp - 1) residuals
            full = torch.stack([r.double() for r in ranks]).sum(0) - (len(ranks) - 1) * res.double()
            out.append((calc_diff(full, ref), P, name, "plus-residual", thr))
    return out


def diagnose_tensors(ranks: list[torch.Tensor], reference: dict[str, torch.Tensor], asked: str,
                     residual: dict[str, torch.Tensor] | None = None) -> Verdict:
    """Infer what `ranks` (rank r's local `[rows, width]` tensor, in rank order) hold, given the
    reference candidates (name -> full `[T, W]`) and the name the user `asked` for.

    `residual` (candidate name -> the residual `[T, W]` its `hidden + residual` adds) also tries
    `Partial(sum)` of the hidden part with the residual added on every rank: what a model-level
    capture holds when the all-reduce is deferred into the next layer (ar-fusion).

    The lowest-diff pair within its threshold wins (ties: the asked name, then Replicate(),
    Shard(dim=0), Shard(dim=-1), Partial(sum)); none within: `unexplained` with the closest."""
    if not ranks:
        raise ValueError("diagnose_tensors needs at least one rank")
    if any(r.dim() != 2 for r in ranks):
        raise ValueError(f"rank tensors must be 2-D [rows, width], got {[list(r.shape) for r in ranks]}")
    tries = _tries(ranks, reference, residual)
    order = {p: i for i, p in enumerate(PLACEMENTS)}
    key = lambda t: (t[0], t[2] != asked, order[t[1]])  # noqa: E731
    good = sorted((t for t in tries if t[0] <= t[4]), key=key)
    if not good:
        return _unexplained(ranks, reference, asked, tries)
    diff, placement, name, detail, _ = good[0]
    also = sorted({t[2] for t in good[1:] if t[2] != name and not _same(reference[t[2]], reference[name])})
    return Verdict(asked, placement, name, placement == R and name == asked, diff,
                   _reason(ranks, reference, asked, placement, name, detail, diff, also))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor under two names (an alias, or equal values: a TP=1 `x.partial` is `x.out`)."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _unexplained(ranks, reference, asked, tries) -> Verdict:
    shapes = shapes_text([list(r.shape) for r in ranks])
    if not tries:
        full = sorted({str(list(t.shape)) for t in reference.values()})
        return Verdict(asked, UNEXPLAINED, None, False, math.inf,
                       f"no placement fits the shapes: ranks {shapes}, reference candidates {', '.join(full)}")
    diff, placement, name, _, thr = min(tries, key=lambda t: (math.isnan(t[0]), t[0]))
    bad = "" if all(torch.isfinite(r).all() for r in ranks) else "the ranks hold NaN or Inf; "
    return Verdict(asked, UNEXPLAINED, None, False, diff,
                   f"{bad}no placement explains it; closest: {placement} of {name} with diff {diff:.2e} > {thr:.0e}"
                   f"{_missing(reference, asked)}")


def _missing(reference, asked) -> str:
    return "" if asked in reference else f" (the reference has no {asked})"


def _reason(ranks, reference, asked, placement, name, detail, diff, also) -> str:
    tp = len(ranks)
    wrong = "" if name == asked else (f"; this is {name}, you asked for {asked}" if asked in reference
                                      else f" (the reference has no {asked})")
    if placement == R:
        same = ("" if tp == 1 else f" (bitwise identical on all {tp} ranks)" if identical(ranks)
                else f" (ranks not bitwise identical; largest rank diff {diff:.1e})")
        if name != asked and asked in reference:
            text = f"replicated, but this is {name}, you asked for {asked}{same}"
        else:
            text = f"{'the lone rank' if tp == 1 else 'every rank'} holds the full {name}{same}{wrong}"
    elif placement == P and detail == "plus-residual":
        text = (f"captured before a deferred all-reduce (per-rank partial sums of the layer output plus the "
                f"replicated residual): summed over {tp} ranks, less {tp - 1} residuals, they are {name}{wrong}")
    elif placement == P:
        text = f"captured before an all-reduce (per-rank partial sums): the sum over {tp} ranks is {name}{wrong}"
    elif placement == S0:
        text = (f"each rank holds only its share of the tokens (rows {detail}): concatenated they are "
                f"{name}{wrong}")
    else:
        pad = f", the last {detail.split(':')[1]} columns padding" if detail else ""
        text = (f"each rank holds only a slice of the hidden dim (widths {'+'.join(str(r.shape[1]) for r in ranks)}"
                f"{pad}): concatenated they are {name}{wrong}")
    if also:
        text += f"; also within the threshold: {', '.join(also)}"
    return text


def shapes_text(shapes: list[list[int]]) -> str:
    """`[12, 16] x4`, or for uneven shards `[4+4+2+2, 16]` / `[12, 8+8]`."""
    if all(s == shapes[0] for s in shapes):
        return f"{shapes[0]} x{len(shapes)}"
    if all(len(s) == 2 for s in shapes):
        if len({s[1] for s in shapes}) == 1:
            return f"[{'+'.join(str(s[0]) for s in shapes)}, {shapes[0][1]}]"
        if len({s[0] for s in shapes}) == 1:
            return f"[{shapes[0][0]}, {'+'.join(str(s[1]) for s in shapes)}]"
    return " ".join(map(str, shapes))


# --- reading rank files ----------------------------------------------------------------------

RANK_DUMP_FORMAT = "tpsim-rank-dump"
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
    from safetensors import safe_open

    from tpsim.files.safetensors import tensor_sha256
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


def check_consistent(rs: RankSet, point: str) -> None:
    """One dtype on every rank, 2-D tensors, and equal shapes or equal widths (uneven token shards)."""
    ts = rs.points[point]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in ts})
    if len(dtypes) > 1:
        raise UsageError(f"point {point}: the ranks hold different dtypes ({', '.join(dtypes)}); pass the files "
                         f"of one run")
    shapes = [list(t.shape) for t in ts]
    if any(len(s) != 2 for s in shapes) or len({s[1] for s in shapes}) > 1:
        raise UsageError(f"point {point}: the ranks' shapes {shapes} are inconsistent (a run's ranks hold equal "
                         f"shapes or, token-sharded, equal widths); pass the files of one run")


# --- reading the reference -------------------------------------------------------------------

@dataclass
class Reference:
    """Candidates (name -> `[T, W]`) of a reference file; aliases share the tensor object."""

    path: str
    kind: str
    candidates: dict[str, torch.Tensor]
    input_ids: torch.Tensor | None = None


def parse_positions(text: str) -> list[str]:
    from tpsim.capture.positions import Position
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


def check_tokens(rs: RankSet, ref: Reference) -> None:
    Ts = sorted({t.shape[0] for t in ref.candidates.values()})
    T = len(rs.input_ids) if rs.input_ids is not None else None
    if T is not None and Ts and Ts != [T]:
        raise UsageError(f"the reference {ref.path} has {'/'.join(map(str, Ts))} tokens and the rank files {T}; "
                         f"compare captures of the same input")
    if T is not None and ref.input_ids is not None:
        if len(ref.input_ids) != T:
            raise UsageError(f"the reference {ref.path} has {len(ref.input_ids)} input_ids and the rank files {T}; "
                             f"compare captures of the same input")
        if not torch.equal(ref.input_ids.long(), rs.input_ids.long()):
            raise UsageError(f"the reference {ref.path} holds other input_ids than the rank files; compare "
                             f"captures of the same input")


# --- the command -----------------------------------------------------------------------------

def asked_name(rs: RankSet, ref: Reference, point: str) -> str:
    """The reference candidate the point means: its own name, else its position."""
    if point in ref.candidates:
        return point
    return rs.position.get(point, point)


def diagnose_files(files: list[str], reference: str, points: list[str] | None = None,
                   positions: list[str] | None = None, hidden: int | None = None, step: int | None = None) -> dict:
    """Read, validate and diagnose; the report `tpsim diagnose --json` prints."""
    rs = read_rank_files(files, step, points)
    ref = read_reference(reference, positions, hidden)
    check_tokens(rs, ref)
    if points:
        if len(set(points)) != len(points):
            raise UsageError("--point names a point twice; name each once")
        for p in points:
            if p not in rs.points:
                raise unknown_point(p, rs.available)
    names = points or list(rs.points)
    if not names:
        raise UsageError("the rank files hold no point present on every rank")
    for p in names:
        check_consistent(rs, p)
    rows = []
    for p in names:
        ts = rs.points[p]
        v = diagnose_tensors(ts, ref.candidates, asked_name(rs, ref, p))
        declared, cand = rs.declared.get(p), ref.candidates.get(v.matches or v.point)
        others = [cand] if cand is not None else list(ref.candidates.values())
        rows.append({**asdict(v), "point": p, "asked": v.point, "diff": v.diff if math.isfinite(v.diff) else None,
                     "ranks": len(ts), "shapes": [list(t.shape) for t in ts],
                     "dtype": str(ts[0].dtype).removeprefix("torch."),
                     "threshold": match_threshold(ts[0].dtype, *(c.dtype for c in others)),
                     "ranks_identical": identical(ts), "declared": declared,
                     "declared_agrees": None if declared is None or v.placement == UNEXPLAINED
                     else declared == v.placement})
    absent = [p for p in names if asked_name(rs, ref, p) not in ref.candidates]
    notes = rs.notes + ([f"the reference has nothing named like {len(absent)} of the points ({', '.join(absent)}): "
                         f"they can only match another candidate"] if absent else [])
    return {"files": rs.files, "kind": rs.kind, "tp": rs.tp,
            "tokens": None if rs.input_ids is None else len(rs.input_ids),
            "reference": {"path": ref.path, "kind": ref.kind, "candidates": list(ref.candidates)},
            "similarity": "calc_diff = 1 - 2*sum(x*y) / sum(x*x + y*y), float64 (0 = identical)",
            "thresholds": {"float32/float64 on both sides": THRESHOLDS["exact"],
                           "bfloat16/float16 on either side": THRESHOLDS["low_precision"]},
            "notes": notes, "points": rows, "ok": all(r["correct"] for r in rows)}


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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diagnose)


def _int_option(text: str | None, option: str, low: int) -> int | None:
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not an integer") from None
    if v < low:
        raise UsageError(f"{option} {v} must be at least {low}")
    return v


def cmd_diagnose(args) -> int:
    from tpsim.cli import emit_json
    positions = parse_positions(args.positions) if args.positions else None
    report = diagnose_files(args.files, args.reference, args.point, positions,
                            _int_option(args.hidden_size, "--hidden-size", 1), _int_option(args.step, "--step", 0))
    if args.json:
        emit_json(report)
    else:
        print_report(report)
    return 0 if report["ok"] else 1


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.markup import escape

    from tpsim.ui import stdout, table
    out = stdout if stdout.is_terminal else Console(highlight=False, width=1000)  # a pipe: one line per row
    say = lambda text: out.print(escape(text))  # noqa: E731  (names like x[layer_id=3] are not markup)
    toks = "" if rep["tokens"] is None else f", {rep['tokens']} tokens"
    say(f"tpsim diagnose: {len(rep['files'])} rank files ({rep['kind']}, tp={rep['tp']}{toks})")
    ref = rep["reference"]
    say(f"reference: {ref['path']} ({ref['kind']}): {', '.join(ref['candidates'])}")
    say(f"similarity: {rep['similarity']}; a match needs <= {THRESHOLDS['exact']:.0e} (float32/float64 on both "
        f"sides) or <= {THRESHOLDS['low_precision']:.0e} (bfloat16/float16 on either side)")
    for n in rep["notes"]:
        say(f"note: {n}")
    show_declared = any(r["declared"] for r in rep["points"])
    cols = ["point", "ranks", "shape per rank", "placement", *(["declared"] if show_declared else []),
            "matches", "diff", "correct", "reason"]
    rows = []
    for r in rep["points"]:
        decl = [] if not show_declared else [
            "-" if r["declared"] is None else r["declared"] + (" (disagrees)" if r["declared_agrees"] is False else "")]
        rows.append([escape(c) for c in (
            r["point"], str(r["ranks"]), shapes_text(r["shapes"]), r["placement"], *decl, r["matches"] or "-",
            "-" if r["diff"] is None else f"{r['diff']:.2e}", "yes" if r["correct"] else "NO", r["reason"])])
    out.print(table("", cols, rows))
    bad = [r["point"] for r in rep["points"] if not r["correct"]]
    if not bad:
        say(f"PASS: every point is Replicate() and the asked tensor on all {rep['tp']} ranks")
    else:
        say(f"FAIL: {len(bad)} of {len(rep['points'])} points are not Replicate() of the asked tensor: "
            f"{', '.join(bad)}")
