"""Check that files tpsim wrote are whole and unchanged (`tpsim verify`).

Every safetensors file tpsim writes (captures, rank dumps, checkpoint exports) carries a
`sha256.<tensor>` checksum per tensor in its metadata. verify re-reads each tensor and
compares; a directory means every `*.safetensors` in it (and, for a sharded export, that
its index names only tensors its shards hold). Exit 0 all match, 1 a mismatch or a file
without checksums, 2 bad input.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from tpsim.weights.reader import Checkpoint
from tpsim.weights.reader import read_header
from tpsim.base.errors import UsageError
from tpsim.base.safetensors import tensor_sha256


def verify_file(path: Path) -> list[str]:
    """Problems with one file (empty: whole and unchanged). A truncated or corrupt file is a
    verdict (its header's problem), not bad input: that is what verify is asked."""
    if not path.is_file():
        raise UsageError(f"{path} is not a regular file; pass a file or directory tpsim wrote")
    try:
        names = list(read_header(path))
    except UsageError as e:
        return [str(e).replace(f"{path} ", "", 1)]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        missing = [n for n in names if f"sha256.{n}" not in meta]
        if missing:
            return [f"{len(missing)} of {len(names)} tensors have no checksum (e.g. {missing[0]}): "
                    "not written by tpsim, or written before checksums; nothing to verify against"]
        return [f"tensor {n}: checksum mismatch (recorded {meta[f'sha256.{n}'][:12]}..., "
                f"found {found[:12]}...): the file changed after tpsim wrote it"
                for n in names if (found := tensor_sha256(f.get_tensor(n))) != meta[f"sha256.{n}"]]


def files_of(target: Path) -> list[Path]:
    if not target.exists():
        raise UsageError(f"{target} does not exist; pass a file or directory tpsim wrote")
    if target.is_dir():
        files = sorted(target.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{target} holds no *.safetensors files; pass a capture, a rank dump or an export")
        return files
    return [target]


def check_index(d: Path) -> list[str]:
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        Checkpoint(d)  # checks that every indexed tensor is in the shard the index names
    except UsageError as e:
        return [str(e)]
    return []
