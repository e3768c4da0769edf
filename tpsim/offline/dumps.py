"""Reading one run's per-rank files, for `tpsim diagnose` (its reference: tpsim.offline.reference).

Inputs of the command: per-rank tpsim rank dumps (`{stem}.rank{r}.safetensors`,
`format=tpsim-rank-dump`), SGLang debug-dumper `.pt` files (the layouts below), or one vLLM
hidden-states file (below).

SGLang's dumper (`python/sglang/srt/debug_utils/dumper.py`), as read in sgl-project/sglang:
- at 5a7255c6 (releases 0.4.10 to 0.5.8): `torch.save(value)` of the bare tensor to
  `sglang_dump_{time}/forward_pass_id={n}___rank={r}___name={name}___dump_index={i}[___k=v...].pt`;
- release 0.5.9: the dict of 09d99f36, to
  `sglang_dump_{time}/forward_pass_id={n}___rank={r}___dump_index={i}___name={name}[___k=v...].pt`;
- at 09d99f36 (in no release from 0.4.10 to 0.5.23): `torch.save({"value": tensor, "meta": {...}})` to
  `sglang_dump_{time}/curr_step={n}___rank={r}___dump_index={i}___name={name}[___k=v...].pt`;
- at 00d35548 (releases 0.5.10 to 0.5.23): the same dict, to
  `{exp_name}/step={n}___rank={r}___dump_index={i}___name={name}___recompute_status=...[___k=v...].pt`
  (from 0.5.13, `DUMPER_INCLUDE_PARALLEL_RANK_IN_FILENAME=1` adds `___pp_rank=...___tp_rank=...`).
The dict's meta holds the filename tags, `world_rank`, `world_size` and `sglang_parallel_info`
(`tp_rank`, `tp_size`, ...; only `distributed_error` outside SGLang); the newer dumper's default
non-intrusive mode also dumps the batch's `input_ids` (name `input_ids`).
`rank` is the global rank; `tp_rank` / `tp_size` from the meta win when present. A dump named
`layer_start__hidden_states` with `layer_id=k` is taken to be the residual stream entering
layer k (`hidden_states + residual`, what EAGLE-3 captures): `embed` for k = 0, else out(k-1).

vLLM's `ExampleHiddenStatesConnector` (`vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py`, with `speculative_config={"method": "extract_hidden_states"}`),
releases 0.17.0 to 0.33.0 of vllm-project/vllm: `safetensors.torch.save_file` of `hidden_states`
`[T, n, H]` (the n aux layers of `eagle_aux_hidden_state_layer_ids`, in the model loop's ascending
layer order; the model dtype) and `token_ids` `[T]` (int64), no metadata, to
`{shared_storage_path}/{req_id}.safetensors`, one file per request. It is one copy for the whole
TP group: from 0.24.0 only TP rank 0 writes it (before, every TP rank wrote the same path), and
the model loop captures `hidden_states + residual` (deepseek_v2.py all-gathers it when token-split,
from 0.25.0). Slot i is the point `slot{i}`; the file names neither the layers nor the TP degree,
so slot i is compared with the reference's `slot{i}`: a vLLM file's slot i, a split by
`--hidden-size`, or the i-th slot of a capture made with vLLM's convention. Given the server's
ids (`--layer-ids`, vLLM's numbering: id k is `embed` for k = 0, else out(k-1); converted by
tpsim.capture.resolve's `vllm-ids` convention), slot i is the point named by the i-th position in
ascending order, `slot{i}` its alias, and is compared with the reference's tensor at that
position, in whatever convention the reference was captured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import torch
from safetensors import safe_open

from tpsim.profiles.conventions import Convention, resolve
from tpsim.base.errors import UsageError
from tpsim.base.tensors import nonfinite
from tpsim.base.torchfile import load_pt, short_error
from tpsim.capture.files import RANK_DUMP_FORMAT
from tpsim.base.safetensors import tensor_sha256

SGLANG_STEP_KEYS = ("step", "forward_pass_id", "curr_step")
SGLANG_BOOKKEEPING = {"rank", "dump_index", "name", "recompute_status", *SGLANG_STEP_KEYS,
                      "pp_rank", "tp_rank", "cp_rank", "ep_rank", "etp_rank"}
SGLANG_RESIDUAL_AT_LAYER_START = ("layer_start__hidden_states", "layer_start_hidden_states")
VLLM_HIDDEN, VLLM_TOKENS = "hidden_states", "token_ids"
VLLM_FIX = "pass the {req_id}.safetensors that vLLM's hidden-states connector wrote"


class DumpKind(StrEnum):
    """What wrote a run's files."""

    TPSIM = "tpsim rank dump"
    SGLANG = "SGLang dumper"
    VLLM = "vLLM hidden-states connector"
    CAPTURE = "tpsim capture"  # tpsim.offline.capture_read

    @property
    def gathered(self) -> bool:
        """One copy for the whole TP group, not one file per rank."""
        return self in (DumpKind.VLLM, DumpKind.CAPTURE)


@dataclass
class RankSet:
    """One run's per-rank files, validated: `points[p][r]` is rank r's `[rows, w]` tensor
    (a gathered kind: one "rank", the copy every rank shares)."""

    kind: DumpKind
    files: list[str]                   # rank order (SGLang: one file per rank of the first point)
    tp: int
    points: dict[str, list[torch.Tensor]]
    position: dict[str, str] = field(default_factory=dict)   # point -> position it is (if any)
    declared: dict[str, str] = field(default_factory=dict)   # point -> placement.<point> metadata
    input_ids: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)
    available: list[str] = field(default_factory=list)      # every point name, also those not read
    aliases: dict[str, str] = field(default_factory=dict)    # another name -> the point (vLLM: slot{i})
    sources: dict[str, list[str]] = field(default_factory=dict)  # point -> each rank's file, where not `files`

    def source(self, point: str, rank: int) -> str:
        """The file rank `rank`'s tensor of `point` was read from."""
        files = self.sources.get(point, self.files)
        return files[rank] if rank < len(files) else files[0]

    def nonfinite(self, point: str) -> str:
        """'' when every rank's tensor of `point` is finite, else each rank that is not: its file and
        how many NaN and Inf values it holds (a silent wrong answer otherwise: a NaN compares as no
        difference in some similarity measures)."""
        bad = []
        for r, t in enumerate(self.points[point]):
            if counted := nonfinite(t):
                bad.append(f"rank {r} ({self.source(point, r)}) holds {counted}")
        return "; ".join(bad)


def _unreadable(path: Path, e: BaseException) -> UsageError:
    return UsageError(f"{path} is not a readable safetensors file ({short_error(e)}); pass the file tpsim or the engine "
                      f"wrote, whole")


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise UsageError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")


def safetensors_header(path: Path) -> tuple[dict[str, str], list[str]]:
    """(metadata, tensor names) of a safetensors file, no tensor read."""
    _check_file(path)
    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}, list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise _unreadable(path, e) from None


def open_safetensors(path: Path, keep: set[str] | None = None):
    """(metadata, {name: tensor}, every name) of a safetensors file, every `sha256.<tensor>`
    verified (one tensor at a time; only the names in `keep` are returned, all when None)."""
    _check_file(path)
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
        raise _unreadable(path, e) from None
    if bad is not None:
        raise UsageError(f"{path}: tensor {bad!r} fails its sha256 checksum (the file is corrupt or was edited); "
                         f"write it again")
    return meta, tensors, names


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
    rs = RankSet(DumpKind.TPSIM, [str(d.path) for d in dumps], tps[0],
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
    rs = RankSet(DumpKind.SGLANG, [str(v[0]) for v in next(iter(kept.values()))], tp, {}, available=available)
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
        rs.sources[name] = [str(v[0]) for v in items]
        pos = sglang_position(items[0][2])
        if pos:
            rs.position[name] = pos
    return rs


@dataclass(frozen=True)
class VllmRequest:
    """One request's file of vLLM's hidden-states connector (module docstring)."""

    path: Path
    hidden_states: torch.Tensor   # [T, n, H]: n aux layers, ascending layer id
    token_ids: torch.Tensor       # [T]

    @property
    def slots(self) -> list[str]:
        return [f"slot{i}" for i in range(self.hidden_states.shape[1])]

    def slot(self, i: int) -> torch.Tensor:
        return self.hidden_states[:, i].contiguous()


def vllm_request(path: Path, tensors: dict[str, torch.Tensor], what: str) -> VllmRequest:
    """Validate vLLM's two tensors (`what` names the file in messages)."""
    missing = [k for k in (VLLM_HIDDEN, VLLM_TOKENS) if k not in tensors]
    if missing:
        raise UsageError(f"{what} has no {missing[0]} tensor (found: {', '.join(tensors) or 'nothing'}); {VLLM_FIX}")
    hs, ids = tensors[VLLM_HIDDEN], tensors[VLLM_TOKENS]
    if hs.dim() != 3 or 0 in hs.shape[1:] or not hs.is_floating_point():
        raise UsageError(f"{what}: {VLLM_HIDDEN} is {str(hs.dtype).removeprefix('torch.')} {list(hs.shape)}, not "
                         f"vLLM's floating [tokens, aux layers, hidden]; {VLLM_FIX}")
    if ids.dim() != 1 or len(ids) != hs.shape[0] or ids.is_floating_point():
        raise UsageError(f"{what}: {VLLM_TOKENS} is {str(ids.dtype).removeprefix('torch.')} {list(ids.shape)} for "
                         f"{hs.shape[0]} tokens of {VLLM_HIDDEN}; {VLLM_FIX}")
    return VllmRequest(path, hs, ids)


GATHERED = ("gathered: vLLM's hidden-states connector writes one copy per request for the whole TP group "
            "(from vLLM 0.24.0 TP rank 0 writes it; before, every rank wrote the same file), so per-rank "
            "placement cannot be seen; each slot is compared whole with ")
GATHERED_NOTE = GATHERED + "the reference's slot of the same index (slot0, slot1, ...)"
UNKNOWN_LAYERS = 1 << 62  # num_layers not known: the ids' upper end goes unchecked (as in reference.parse_positions)
LAYER_IDS_FIX = "pass the eagle_aux_hidden_state_layer_ids vLLM ran with, one per slot"


def vllm_slot_names(req: VllmRequest, ids: list[int], num_layers: int | None) -> list[str]:
    """The positions vLLM's `eagle_aux_hidden_state_layer_ids` put in the file's slots, ascending as
    vLLM writes them (id k: the residual stream entering layer k; tpsim.capture.resolve's `vllm-ids`
    convention). `num_layers` None: the ids' upper end (num_layers: out(num_layers-1)) goes unchecked;
    no id names a position that needs it."""
    text, (T, n, H) = ",".join(map(str, ids)), req.hidden_states.shape
    if num_layers is None and ids and min(ids) < 0:
        raise UsageError(f"--layer-ids {text}: layer id {min(ids)} is negative (vLLM's ids run from 0, embed, to "
                         f"num_layers, the last layer's output); {LAYER_IDS_FIX}")
    try:
        res = resolve(Convention.VLLM, ids, UNKNOWN_LAYERS if num_layers is None else num_layers)
    except UsageError as e:
        raise UsageError(f"--layer-ids {text}: {e}; {LAYER_IDS_FIX}") from None
    names = [str(p) for p in res.positions]
    if len(names) != n:
        distinct = " distinct" if len(names) != len(ids) else ""
        raise UsageError(f"--layer-ids {text} names {len(names)}{distinct} layers ({','.join(names)}) but {req.path} "
                         f"holds {n} slots ([{T}, {n}, {H}]); {LAYER_IDS_FIX}")
    return names


def read_vllm(paths: list[Path], keep: set[str] | None = None, layer_ids: list[int] | None = None,
              num_layers: int | None = None) -> RankSet:
    """One vLLM hidden-states file: slot i of its `[T, n, H]` is the point `slot{i}`, one "rank"; with
    `layer_ids` the point is named by its position (`out(1)`) and `slot{i}` is an alias."""
    if len(paths) != 1:
        names = ", ".join(p.name for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
        raise UsageError(f"{len(paths)} vLLM hidden-states files ({names}), one per request; pass the one whose "
                         f"tokens the reference holds")
    _, tensors, _ = open_safetensors(paths[0])
    req = vllm_request(paths[0], tensors, str(paths[0]))
    names = req.slots if layer_ids is None else vllm_slot_names(req, layer_ids, num_layers)
    aliases = {} if layer_ids is None else dict(zip(req.slots, names))
    keep = None if keep is None else {aliases.get(k, k) for k in keep}
    unknown = sorted((keep or set()) - set(names) - {"input_ids"})
    if unknown:
        raise unknown_point(unknown[0], names)
    points = {n: [req.slot(i)] for i, n in enumerate(names) if keep is None or n in keep}
    note = GATHERED_NOTE if layer_ids is None else (
        GATHERED + f"the reference's tensor at the position --layer-ids {','.join(map(str, layer_ids))} names ("
        + ", ".join(f"{s} = {n}" for s, n in aliases.items()) + ")")
    return RankSet(DumpKind.VLLM, [str(req.path)], 1, points, input_ids=req.token_ids, notes=[note],
                   available=names, aliases=aliases, position={n: n for n in names} if layer_ids is not None else {})


def unknown_point(p: str, available: list[str]) -> UsageError:
    avail = ", ".join(available[:8]) + (", ..." if len(available) > 8 else "")
    return UsageError(f"--point {p}: no such point in every rank file (points: {avail or 'none'})")
