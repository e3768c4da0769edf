"""safetensors files with string metadata and a `sha256.<tensor>` checksum per tensor
(`tpsim verify` checks them), written atomically."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tpsim.base.atomic import atomic_write


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def safetensors_writer(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[str], None]:
    """What writes `tensors` with `metadata` and a checksum per tensor into a (temporary) file."""
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    meta = {**metadata, **{f"sha256.{k}": tensor_sha256(v) for k, v in tensors.items()}}
    return lambda tmp: save_file(tensors, tmp, metadata=meta)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    atomic_write(path, safetensors_writer(tensors, metadata))
