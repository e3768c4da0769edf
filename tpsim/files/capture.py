"""Files tpsim writes: safetensors with string metadata and a `sha256.<tensor>` checksum per
tensor, written atomically (temporary name in the same directory, fsync, rename).

- A capture: `aux_hidden_states` `[T, n * hidden]` (Replicate(), checked identical on every
  rank) and `input_ids` `[T]`.
- A rank dump (`--points`): one file per rank, `{stem}.rank{r}{suffix}`, holding that rank's
  local tensor of each named point, `input_ids` `[T]` (the whole sequence), and metadata
  `format=tpsim-rank-dump`, `rank`, `tp`, `points`, `placement.<point>`, `position.<point>`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpsim.capture.points import position_of
from tpsim.files.safetensors import write_safetensors

RANK_DUMP_FORMAT = "tpsim-rank-dump"


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
        meta[f"placement.{name}"] = str(tap.placement)
        if position_of(name):
            meta[f"position.{name}"] = position_of(name)
    tensors = {name: tap.tensor for name, tap in taps.items()}
    write_safetensors(path, {**tensors, "input_ids": torch.tensor(input_ids, dtype=torch.long)}, meta)
    return path
