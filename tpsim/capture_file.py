"""Capture files: safetensors with `aux_hidden_states` `[T, n * hidden]`, `input_ids` `[T]` and
string metadata, written atomically (temporary name in the same directory, fsync, rename)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def write_capture(path: Path, capture: torch.Tensor, input_ids: list[int], metadata: dict[str, str]) -> None:
    tensors = {"aux_hidden_states": capture.contiguous().cpu(),
               "input_ids": torch.tensor(input_ids, dtype=torch.long)}
    meta = {**metadata, **{f"sha256.{k}": tensor_sha256(v) for k, v in tensors.items()}}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
