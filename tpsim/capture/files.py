"""Files tpsim writes: safetensors with string metadata and a `sha256.<tensor>` checksum per
tensor, written atomically (temporary name in the same directory, fsync, rename).

- A capture: `aux_hidden_states` `[T, n * hidden]` (Replicate(), checked identical on every
  rank) and `input_ids` `[T]`.
- A rank dump (`--points`): one file per rank, `{stem}.rank{r}{suffix}`, holding that rank's
  local tensor of each named point, `input_ids` `[T]` (the whole sequence), and metadata
  `format=tpsim-rank-dump`, `rank`, `tp`, `points`, `placement.<point>`, `position.<point>`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tpsim.capture.points import position_of
from tpsim.base.atomic import atomic_write_all
from tpsim.base.safetensors import safetensors_writer, write_safetensors

RANK_DUMP_FORMAT = "tpsim-rank-dump"


def write_capture(path: Path, capture: torch.Tensor, input_ids: list[int], metadata: dict[str, str]) -> None:
    write_safetensors(path, {"aux_hidden_states": capture, "input_ids": torch.tensor(input_ids, dtype=torch.long)},
                      metadata)


def rank_dump_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def rank_dumps_present(out: Path) -> dict[int, Path]:
    """The rank dumps of `out` on disk, by rank (an earlier run's, perhaps at another TP)."""
    name = re.compile(re.escape(out.stem) + r"\.rank(\d+)" + re.escape(out.suffix))
    return {int(m.group(1)): p for p in out.parent.iterdir() if (m := name.fullmatch(p.name))}


def write_rank_dumps(out: Path, tp: int, taps: dict[int, dict], input_ids: list[int], metadata: dict[str, str]) -> None:
    """Write each rank's tapped points (`taps[rank]`: name -> Tap with its tensor) next to `out`,
    all or none: every file is written before any replaces its predecessor."""
    ids = torch.tensor(input_ids, dtype=torch.long)
    files = []
    for rank, points in sorted(taps.items()):
        meta = {**metadata, "format": RANK_DUMP_FORMAT, "rank": str(rank), "tp": str(tp), "points": ",".join(points)}
        for name, tap in points.items():
            meta[f"placement.{name}"] = str(tap.placement)
            if position_of(name):
                meta[f"position.{name}"] = position_of(name)
        tensors = {name: tap.tensor for name, tap in points.items()}
        files.append((rank_dump_path(out, rank), safetensors_writer({**tensors, "input_ids": ids}, meta)))
    atomic_write_all(files)
