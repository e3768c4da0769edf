"""Run a job on real ranks: under torchrun when launched by it, else a self-spawned pool."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import torch

from tpsim.errors import RankError, UsageError
from tpsim.parallel.launch import RankPool, default_backend, gather_to_rank0, init_from_env, under_torchrun

_TORCHRUN_CTX = None


def is_reporting_process() -> bool:
    """The process that prints results: the launcher, or global rank 0 under torchrun."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def pick_backend(device: str, backend: str | None, world: int) -> str:
    if backend:
        if backend == "nccl" and device != "cuda":
            raise UsageError("--backend nccl needs --device cuda; use gloo on CPU")
        return backend
    if device == "cuda" and not under_torchrun() and torch.cuda.device_count() < world:
        print(f"tpsim: warning: {world} ranks but {torch.cuda.device_count()} GPU(s): using gloo over CUDA "
              "tensors, which measures nothing about speed", file=sys.stderr)
        return "gloo"
    return default_backend(device)


def run_on_ranks(job: Callable, world: int, *, device: str, backend: str | None, timeout_s: float,
                 progress=None, **kwargs) -> dict | None:
    """{global rank: job result} on the reporting process; None on other torchrun ranks."""
    global _TORCHRUN_CTX
    if under_torchrun():
        if _TORCHRUN_CTX is None:
            _TORCHRUN_CTX = init_from_env(device, backend, timeout_s)
        try:
            result = job(_TORCHRUN_CTX, **kwargs)
        except (UsageError, RankError):
            raise
        except Exception as e:
            raise RankError(f"rank {_TORCHRUN_CTX.rank} failed while running {job.__name__}: "
                            f"{e.__class__.__name__}: {e}\n{traceback.format_exc()}") from e
        return gather_to_rank0(result)
    backend = pick_backend(device, backend, world)
    if progress:
        progress(f"starting {world} {backend} rank{'s' if world > 1 else ''}")
    with RankPool(world, backend, device, timeout_s, on_progress=progress) as pool:
        return pool.run(job, **kwargs)
