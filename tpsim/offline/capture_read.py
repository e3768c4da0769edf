"""Reading one run's files for `tpsim diagnose`: which kind they are (`read_rank_files`; tpsim.offline.dumps
reads each kind: tpsim rank dumps, SGLang dumper files, vLLM hidden-states files), or a tpsim capture
file (below).

A tpsim capture (`tpsim capture --out`, tpsim.capture.files) holds `aux_hidden_states` `[T, n*H]`,
the slots in the order the engine concatenates them, and its `positions` metadata (what the
replayed engine captured). It is one copy for the whole TP group: capture refuses to write one that
differs between ranks. Slot i is the point named by the i-th recorded position. Given ids and the
convention that numbers them (`--layer-ids`, `--convention`), slot i is instead named by the i-th
position they resolve to, in that convention's concatenation order: the draft's ids in its
trainer's numbering name each slot by what the draft was trained on, so a slot the engine took from
another layer is diagnosed as that layer ("this is out(1), you asked for out(2)").
"""

from __future__ import annotations

from pathlib import Path

from tpsim.profiles.conventions import Convention, check_convention, resolve
from tpsim.base.errors import UsageError
from tpsim.capture.files import RANK_DUMP_FORMAT
from tpsim.offline.dumps import (UNKNOWN_LAYERS, VLLM_HIDDEN, VLLM_TOKENS, DumpKind, RankSet, open_safetensors,
                               read_sglang, read_tpsim_dumps, read_vllm, safetensors_header, unknown_point)

CAPTURE_TENSOR = "aux_hidden_states"
ONE_COPY = ("a tpsim capture holds one copy for the whole TP group (capture writes it only when every rank "
            "holds the same tensor), so per-rank placement cannot be seen; ")


def is_capture(path: Path) -> bool:
    """A tpsim capture file: `aux_hidden_states` with its `positions` metadata."""
    if path.suffix != ".safetensors" or not path.is_file():
        return False
    meta, names = safetensors_header(path)
    return CAPTURE_TENSOR in names and "positions" in meta


def read_run(files: list[str], step: int | None = None, points: list[str] | None = None,
             layer_ids: list[int] | None = None, num_layers: int | None = None,
             convention: str = Convention.VLLM.value) -> RankSet:
    """One run's files: a tpsim capture file, or tpsim.offline.dumps' kinds (rank dumps, SGLang dumper
    files, a vLLM file whose slots `layer_ids` name in vLLM's numbering)."""
    paths = expand(files)
    captures = [p for p in paths if is_capture(p)]
    if not captures:
        if layer_ids is not None and check_convention(convention) is not Convention.VLLM:
            raise UsageError(f"--convention {convention} numbers --layer-ids for a tpsim capture file; a vLLM file's "
                             "slots are named by the ids vLLM ran with (--convention vllm-ids)")
        return read_rank_files(files, step, points, layer_ids, num_layers)
    if len(paths) != 1:
        raise UsageError(f"{captures[0]} is a tpsim capture (one copy for the whole TP group); pass it alone, "
                         f"not with {len(paths) - 1} other file{'s' if len(paths) > 2 else ''}")
    if step is not None:
        raise UsageError("--step picks a forward pass among SGLang dumper files; a tpsim capture holds one: drop --step")
    return read_capture(captures[0], points, layer_ids, num_layers, convention)


def read_capture(path: Path, points: list[str] | None, layer_ids: list[int] | None, num_layers: int | None,
                 convention: str) -> RankSet:
    meta, tensors, _ = open_safetensors(path, {CAPTURE_TENSOR, "input_ids"})
    aux, recorded = tensors[CAPTURE_TENSOR], [p.strip() for p in meta["positions"].split(",")]
    n = len(recorded)
    if aux.dim() != 2 or aux.shape[1] % n:
        raise UsageError(f"{path}: aux_hidden_states is {list(aux.shape)}, not [T, {n} x hidden] for its positions "
                         f"{','.join(recorded)}; write the capture again")
    L = num_layers if num_layers is not None else int(meta["num_layers"]) if meta.get("num_layers", "").isdecimal() \
        else None
    names = recorded if layer_ids is None else _named(layer_ids, convention, L, n, path)
    slots = [f"slot{i}" for i in range(n)]
    aliases = {s: name for s, name in zip(slots, names) if s != name}
    keep = None if not points else {aliases.get(p, p) for p in points}
    unknown = sorted((keep or set()) - set(names))
    if unknown:
        raise unknown_point(unknown[0], names)
    H = aux.shape[1] // n
    picked = {name: [aux[:, i * H:(i + 1) * H].contiguous()] for i, name in enumerate(names)
              if keep is None or name in keep}
    how = ("each slot is compared whole with the reference's tensor at the position it recorded" if layer_ids is None
           else f"each slot is named by the position --layer-ids {','.join(map(str, layer_ids))} means in "
                f"--convention {convention} and compared with the reference's tensor there ("
                + ", ".join(f"slot{i} = {name}, recorded {rec}" for i, (name, rec) in enumerate(zip(names, recorded)))
                + ")")
    return RankSet(DumpKind.CAPTURE, [str(path)], 1, picked, input_ids=tensors.get("input_ids"),
                   notes=[ONE_COPY + how], available=names, aliases=aliases, position={m: m for m in names})


def _named(ids: list[int], convention: str, L: int | None, n: int, path: Path) -> list[str]:
    """The positions `ids` mean in `convention`, in its concatenation order: one per slot."""
    text = ",".join(map(str, ids))
    try:
        names = [str(p) for p in resolve(convention, ids, UNKNOWN_LAYERS if L is None else L).positions]
    except UsageError as e:
        raise UsageError(f"--layer-ids {text} (--convention {convention}): {e}") from None
    if len(names) != n:
        raise UsageError(f"--layer-ids {text} names {len(names)} positions ({','.join(names)}) in --convention "
                         f"{convention}, but {path} holds {n} slots; pass one id per slot")
    return names


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


def safetensors_kind(path: Path) -> DumpKind:
    """A tpsim rank dump (its `format`) or a vLLM hidden-states file (vLLM's tensor names, no metadata)."""
    meta, names = safetensors_header(path)
    if meta.get("format") == RANK_DUMP_FORMAT:
        return DumpKind.TPSIM
    if "format" not in meta and {VLLM_HIDDEN, VLLM_TOKENS} & set(names):
        return DumpKind.VLLM
    raise UsageError(f"{path} is not a tpsim rank dump (format={meta.get('format')!r}) nor a vLLM hidden-states file "
                     f"({VLLM_HIDDEN} + {VLLM_TOKENS}); pass the {{stem}}.rank{{r}}.safetensors files of one run, "
                     f"or one {{req_id}}.safetensors of vLLM")


def read_rank_files(files: list[str], step: int | None = None, points: list[str] | None = None,
                    layer_ids: list[int] | None = None, num_layers: int | None = None) -> RankSet:
    """One run's rank files (all points, or only `points` and input_ids); a vLLM file's slots named
    by `layer_ids` (vLLM's, see `vllm_slot_names`) when given."""
    paths = expand(files)
    pts = [p for p in paths if p.suffix == ".pt"]
    if pts and len(pts) != len(paths):
        raise UsageError("mix of .pt (SGLang dumper) and other rank files; diagnose one run's files of one kind")
    keep = None if not points else {*points, "input_ids"}
    kinds = [DumpKind.SGLANG] if pts else sorted({safetensors_kind(p) for p in paths})
    if len(kinds) > 1:
        raise UsageError(f"mix of {' and '.join(kinds)} files; diagnose one run's files of one kind")
    if layer_ids is not None and kinds != [DumpKind.VLLM]:
        raise UsageError(f"--layer-ids names the slots of a vLLM hidden-states file or a tpsim capture, and these are "
                         f"{kinds[0]} files, "
                         f"whose points carry their own names; drop --layer-ids")
    if step is not None and not pts:
        raise UsageError(f"--step picks a forward pass among SGLang dumper files; {kinds[0]} files hold one: "
                         "drop --step")
    if pts:
        return read_sglang(pts, step, keep)
    return read_vllm(paths, keep, layer_ids, num_layers) if kinds == [DumpKind.VLLM] else read_tpsim_dumps(paths, keep)
