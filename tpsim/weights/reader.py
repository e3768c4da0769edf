"""Read an HF checkpoint directory of any tpsim family, each rank only its own slices (block-FP8
weights and GPT-OSS's MXFP4 experts dequantized per slice).

A directory holds `config.json` and one or more `*.safetensors`, with or without
`model.safetensors.index.json`. The launcher validates it once from the file headers
(`validate`: every tensor the config implies is present with the right shape and a
supported dtype) before any rank starts; each rank then `load_weights` through
safetensors `get_slice`, so it reads its shard and never a full tensor it does not keep.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from tpsim.weights.fp8 import Fp8Source, scale_shape
from tpsim.weights.mxfp4 import GROUP, Mxfp4Source
from tpsim.config.loader import ModelConfig
from tpsim.config.checks import check_quantization_config
from tpsim.base.errors import UsageError
from tpsim.model.decoder import CausalLM
from tpsim.parallel.group import TPGroup
from tpsim.weights.seeded import fill_weights, weight_specs

INDEX = "model.safetensors.index.json"
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MXFP4 = "MXFP4"  # not a safetensors dtype: a {name}_blocks / {name}_scales pair read as one tensor
WEIGHT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3", MXFP4)
FP8_SCALE_DTYPES = ("F32", "BF16")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file, checked against the file's size, so a truncated
    or corrupt file is a UsageError naming it, never a crash when a slice is read."""
    fix = "re-download or re-export it"
    if path.exists() and not path.is_file():  # a directory, or a FIFO that would block the read forever
        raise UsageError(f"{path} is not a regular file, so not a safetensors file; {fix}")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UsageError(f"{path} is not a safetensors file ({size} bytes, too short for a header); {fix}")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise UsageError(f"{path} is not a complete safetensors file (its header claims {n} bytes, "
                                 f"the file holds {size}); {fix}")
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicates(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        if isinstance(e, OSError) and not isinstance(e, (FileNotFoundError, PermissionError)):
            raise UsageError(f"cannot read {path}: {e.strerror or e}; {fix}")
        if isinstance(e, OSError):
            raise UsageError(f"cannot read {path}: {e.strerror}; check that it exists and is readable")
        raise UsageError(f"{path} is not a safetensors file (its header is not JSON); {fix}")
    if not isinstance(header, dict):
        raise UsageError(f"{path} is not a safetensors file (its header is not a table); {fix}")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UsageError(f"{path} is corrupt: its __metadata__ is not a map of strings; {fix}")
    data = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not (isinstance(dtype, str) and all(type(v) is int and v >= 0 for v in (*shape, begin, end))):
                raise TypeError(name)
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path} is not a safetensors file (bad entry for {name}); {fix}") from None
        if dtype not in ITEMSIZE or end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise UsageError(f"{path} is corrupt: tensor {name} ({dtype} {list(shape)}) has "
                             f"{end - begin} bytes; {fix}")
        if end > data:
            raise UsageError(f"{path} is truncated: tensor {name} ends at byte {end} of the data, the file "
                             f"holds {data}; {fix}")
    _check_layout(path, header, data, fix)
    return header


def _no_duplicates(path: Path):
    """A json object hook that refuses a key given twice (json.loads would keep the last)."""
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise UsageError(f"{path} is corrupt: its header names {k!r} twice; re-download or re-export it")
            out[k] = v
        return out
    return pairs


def _check_layout(path: Path, header: dict, data: int, fix: str) -> None:
    """The tensors tile the data section exactly: in order from byte 0, no overlap, no gap, nothing
    after the last (what the safetensors format requires, and what a rank's slice reads rely on)."""
    at, prev = 0, None
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if begin < at:
            raise UsageError(f"{path} is corrupt: tensor {name} (bytes {begin}..{end}) overlaps {prev}; {fix}")
        if begin > at:
            raise UsageError(f"{path} is corrupt: {begin - at} unclaimed bytes before tensor {name} "
                             f"(the tensors must be contiguous); {fix}")
        at, prev = end, name
    if at != data:
        raise UsageError(f"{path} is corrupt: {data - at} bytes after the last tensor; {fix}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Checkpoint:
    """A checkpoint directory seen through its headers. `source(name)` is the lazy slice
    object `WeightSpec.load` indexes (`open(name)`); `elements_read` counts
    what this process read, in elements."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise UsageError(f"{self.path} is not a directory; pass an HF model directory")
        if not (self.path / "config.json").is_file():
            raise UsageError(f"{self.path} has no config.json; an HF model directory needs config.json "
                             "next to its *.safetensors")
        self.index: dict[str, str] | None = None
        if (self.path / INDEX).is_file():
            files = self._read_index()
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{self.path} holds config.json but no *.safetensors; pass {self.path / 'config.json'} "
                             "to run its config with seeded random weights")
        self.tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (file, dtype, shape)
        for fname in files:
            for name, info in read_header(self.path / fname).items():
                self.tensors[name] = (fname, info["dtype"], tuple(info["shape"]))
        for name in [n.removesuffix("_blocks") for n in self.tensors if n.endswith("_blocks")]:
            if name not in self.tensors and f"{name}_scales" in self.tensors:  # GPT-OSS MXFP4 experts
                fname, _, shape = self.tensors[f"{name}_blocks"]
                *lead, rows, groups, _ = shape if len(shape) >= 3 else (0, 0, 0)  # validate names a bad one
                self.tensors[name] = (fname, MXFP4, (*lead, groups * GROUP, rows))
        if self.index is not None:
            for name, fname in self.index.items():
                if name not in self.tensors or self.tensors[name][0] != fname:
                    raise UsageError(f"{self.path / INDEX} puts {name} in {fname}, which does not hold it; "
                                     "the index and the files disagree: re-download the checkpoint")
        self.block = None
        try:
            raw = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
            raise UsageError(f"{self.path / 'config.json'} is not readable JSON; re-download or re-export it") from None
        if isinstance(raw, dict) and raw.get("quantization_config") is not None:
            self.block = check_quantization_config(raw["quantization_config"], str(self.path / "config.json"))
        self.elements_read = 0

    def _read_index(self) -> list[str]:
        p = self.path / INDEX
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AssertionError, RecursionError):
            raise UsageError(f"{p} is not a safetensors index (JSON with a weight_map); re-download it or delete it")
        missing = sorted({f for f in weight_map.values() if not (self.path / str(f)).is_file()})
        if missing:
            raise UsageError(f"{p} lists {missing[0]}, which is not in {self.path}; download every shard")
        self.index = weight_map
        return sorted(set(weight_map.values()))

    def fingerprint(self) -> str:
        """sha256 of config.json and every tensor's file, dtype, shape and the file sizes (the
        headers, not the data: cheap for a 1 TB checkpoint, and it changes when any shard does)."""
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for name in sorted(self.tensors):
            h.update(repr((name, *self.tensors[name])).encode())
        for fname in sorted({f for f, _, _ in self.tensors.values()}):
            h.update(f"{fname}:{(self.path / fname).stat().st_size}".encode())
        return h.hexdigest()

    def num_layers(self) -> int:
        """How many decoder layers the checkpoint holds: one past the highest model.layers.N."""
        ids = [int(m.group(1)) for n in self.tensors if (m := _LAYER.match(n))]
        return max(ids) + 1 if ids else 0

    def where(self, name: str) -> str:
        """The file that holds `name`, or should: the one holding its layer's other tensors."""
        if name in self.tensors:
            return self.tensors[name][0]
        m = LAYER.match(name)
        prefix = m.group(0) if m else "model."
        near = sorted({f for n, (f, _, _) in self.tensors.items() if n.startswith(prefix)})
        files = sorted({f for f, _, _ in self.tensors.values()})
        return (near or files)[0] if len(near or files) == 1 else f"one of {', '.join(near or files)}"

    @contextmanager
    def open(self, name: str, keep_fp8: bool = False):
        """The lazy slice object of tensor `name` (fp8 weights come dequantized; `keep_fp8`: as
        BlockFp8 parts of their fp8 values and scales), with its file
        mapped only while the block runs: a rank's memory then holds its parameters and the
        slice being copied, not every page of the checkpoint it touched."""
        _, dtype, shape = self.tensors[name]
        with ExitStack() as stack:
            def lazy(n):
                return stack.enter_context(safe_open(str(self.path / self.tensors[n][0]), framework="pt")).get_slice(n)
            if dtype == "F8_E4M3":
                src = Fp8Source(lazy(name), lazy(f"{name}_scale_inv"), self.block, shape, raw=keep_fp8)
            elif dtype == MXFP4:
                src = Mxfp4Source(lazy(f"{name}_blocks"), lazy(f"{name}_scales"))
            else:
                src = lazy(name)
            yield _Counted(self, src)


class _Counted:
    def __init__(self, ckpt: Checkpoint, src):
        self.ckpt, self.src = ckpt, src

    def __getitem__(self, idx) -> torch.Tensor:
        t = self.src[idx]
        self.ckpt.elements_read += t.numel()
        return t


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor `cfg` implies (HF name -> full shape), in model order, from a
    TP=1 model built on the meta device (no memory)."""
    model = CausalLM(cfg, TPGroup(device=torch.device("meta")))
    return {s.name: tuple(s.shape) for s in weight_specs(model)}


def validate(ckpt: Checkpoint, cfg: ModelConfig) -> list[str]:
    """Check, from the headers only, that the checkpoint holds what `cfg` needs; return notes
    on what it holds beyond that (layers past num_hidden_layers, tensors tpsim does not use)."""
    held = ckpt.num_layers()
    if cfg.num_hidden_layers > held:  # before building L layers' shapes: an override of 10**9 layers never ends
        raise UsageError(f"num_hidden_layers={cfg.num_hidden_layers} but the checkpoint {ckpt.path} holds {held} "
                         f"layers (model.layers.0..{held - 1}); use at most {held}")
    expected = expected_tensors(cfg)
    for name, shape in expected.items():
        if name not in ckpt.tensors:
            raise UsageError(f"tensor {name} is missing from {ckpt.path / ckpt.where(name)}; "
                             "the checkpoint does not match its config.json")
        fname, dtype, found = ckpt.tensors[name]
        if found != shape:
            raise UsageError(f"tensor {name} in {ckpt.path / fname} has shape {list(found)}, the config implies "
                             f"{list(shape)}; the checkpoint does not match its config.json")
        if dtype not in WEIGHT_DTYPES:
            raise UsageError(f"tensor {name} in {ckpt.path / fname} is {dtype}; tpsim reads "
                             f"{', '.join(WEIGHT_DTYPES)} weights")
        if dtype == "F8_E4M3":
            _check_fp8(ckpt, name, shape)
        if dtype == MXFP4:
            _check_mxfp4(ckpt, name)
    used = set(expected) | {f"{n}{suffix}" for n in expected for suffix in ("_scale_inv", "_blocks", "_scales")}
    beyond, other = [], []
    for name in ckpt.tensors:
        if name in used:
            continue
        m = LAYER.match(name)
        (beyond if m and int(m.group(1)) >= cfg.num_hidden_layers else other).append(name)
    notes = []
    if beyond:
        layers = sorted({int(LAYER.match(n).group(1)) for n in beyond})
        span = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        notes.append(f"skipped {len(beyond)} tensors of layer{'s' if len(layers) > 1 else ''} {span}, beyond "
                     f"num_hidden_layers={cfg.num_hidden_layers} (an MTP layer, or a truncated run)")
    if other:
        notes.append(f"ignored {len(other)} tensor{'s' if len(other) > 1 else ''} tpsim does not use, "
                     f"e.g. {sorted(other)[0]}")
    return notes


def _check_mxfp4(ckpt: Checkpoint, name: str) -> None:
    """GPT-OSS's MXFP4 pair, from the headers: uint8 blocks [..., rows, G, 16] and uint8 scales [..., rows, G]
    (tpsim.weights.mxfp4); anything else would be cast or fail inside a rank."""
    blocks, scales = f"{name}_blocks", f"{name}_scales"
    (bfile, bdtype, bshape), (sfile, sdtype, sshape) = ckpt.tensors[blocks], ckpt.tensors[scales]
    for t, f, dtype in ((blocks, bfile, bdtype), (scales, sfile, sdtype)):
        if dtype != "U8":
            raise UsageError(f"tensor {t} in {ckpt.path / f} is {dtype}; MXFP4 {t.rpartition('_')[2]} are U8 "
                             "(uint8, as GPT-OSS publishes them): re-export it")
    if len(bshape) < 3 or bshape[-1] != GROUP // 2:
        raise UsageError(f"tensor {blocks} in {ckpt.path / bfile} has shape {list(bshape)}; MXFP4 blocks are "
                         f"[..., rows, groups, {GROUP // 2}] (two FP4 codes a byte, {GROUP} values a group)")
    if tuple(sshape) != tuple(bshape[:-1]):
        raise UsageError(f"tensor {scales} in {ckpt.path / sfile} has shape {list(sshape)}; it must be "
                         f"{list(bshape[:-1])}, one scale per group of {blocks}")


def _check_fp8(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    fname = ckpt.tensors[name][0]
    if ckpt.block is None:
        raise UsageError(f"tensor {name} in {ckpt.path / fname} is float8 but config.json has no "
                         "quantization_config; add DeepSeek-V3's (quant_method fp8, weight_block_size [128, 128])")
    if len(shape) != 2:
        raise UsageError(f"tensor {name} in {ckpt.path / fname} is float8 but not a matrix; "
                         "tpsim dequantizes fp8 linear weights only")
    scale = f"{name}_scale_inv"
    if scale not in ckpt.tensors:
        raise UsageError(f"tensor {name} is float8 but {scale} is missing from {ckpt.path / ckpt.where(scale)}")
    if ckpt.tensors[scale][1] not in FP8_SCALE_DTYPES:
        raise UsageError(f"tensor {scale} in {ckpt.path / ckpt.where(scale)} is {ckpt.tensors[scale][1]}; a block "
                         f"scale is {' or '.join(FP8_SCALE_DTYPES)} (DeepSeek-V3 stores F32): re-export it")
    want = scale_shape(shape, ckpt.block)
    if ckpt.tensors[scale][2] != want:
        raise UsageError(f"tensor {scale} has shape {list(ckpt.tensors[scale][2])}, expected {list(want)} for "
                         f"{list(shape)} in {ckpt.block[0]}x{ckpt.block[1]} blocks")


def load_weights(model: torch.nn.Module, ckpt: Checkpoint, progress=None) -> None:
    """Fill every parameter of a tpsim model (any TP degree) with this rank's slices."""
    keep = model.config.fp8_block is not None
    fill_weights(model, lambda spec, beat: ckpt.open(spec.name, keep), "reading weights", progress)
