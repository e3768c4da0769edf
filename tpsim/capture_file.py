"""Files tpsim writes: safetensors with string metadata and a `sha256.<tensor>` checksum per
tensor, written atomically (temporary name in the same directory, fsync, rename).

- A capture: `aux_hidden_states` `[T, n * hidden]` (Replicate(), checked identical on every
  rank) and `input_ids` `[T]`.
- A rank dump (`--points`): one file per rank, `{stem}.rank{r}{suffix}`, holding that rank's
  local tensor of each named point, `input_ids` `[T]` (the whole sequence), and metadata
  `format=tpsim-rank-dump`, `rank`, `tp`, `points`, `placement.<point>`, `position.<point>`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tpsim.capture.points import position_of
from tpsim.parallel import faults

RANK_DUMP_FORMAT = "tpsim-rank-dump"


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    meta = {**metadata, **{f"sha256.{k}": tensor_sha256(v) for k, v in tensors.items()}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        faults.at("write")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_capture(path: Path, capture: torch.Tensor, input_ids: list[int], metadata: dict[str, str]) -> None:
    write_safetensors(path, {"aux_hidden_states": capture, "input_ids": torch.tensor(input_ids, dtype=torch.long)},
                      metadata)


def rank_dump_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def write_rank_dump(out: Path, rank: int, tp: int, taps: dict, input_ids: list[int], metadata: dict[str, str]) -> Path:
    """Write rank `rank`'s tapped points (name -> Tap with its tensor) next to `out`."""
    path = rank_dump_path(out, rank)
    meta = {**metadata, "format": RANK_DUMP_FORMAT, "rank": str(rank), "tp": str(tp), "points": ",".join(taps)}
    for name, tap in taps.items():
        meta[f"placement.{name}"] = tap.placement
        if position_of(name):
            meta[f"position.{name}"] = position_of(name)
    tensors = {name: tap.tensor for name, tap in taps.items()}
    write_safetensors(path, {**tensors, "input_ids": torch.tensor(input_ids, dtype=torch.long)}, meta)
    return path


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (temporary name in the same directory, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        faults.at("write")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
