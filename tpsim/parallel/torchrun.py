"""Ranks started by torchrun: the world joined (env rendezvous) with tpsim.parallel.launch's TP
groups, results gathered on rank 0, and a rank's clean exit (its environment is checked, without
torch, by tpsim.base.environ)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpsim.base.environ import under_torchrun  # noqa: F401  (imported from here too)
from tpsim.base.errors import UsageError
from tpsim.parallel.launch import RankContext, build_groups, default_backend


def init_from_env(device: str, backend: str | None, timeout_s: float) -> RankContext:
    """Join the torchrun world (env rendezvous) and build the TP groups."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but CUDA is not available here; use --device cpu")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = backend or default_backend(device)
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    return RankContext(rank, world, dev, backend, build_groups(rank, world, dev, timeout_s), all_blocks=True,
                       progress_fn=lambda m: print(f"[rank 0] {m}", file=sys.stderr, flush=True))


def exit_torchrun_rank(code: int) -> None:
    """End a torchrun rank: wait for the others, then exit without running C++ teardown.

    gloo's process-group destructors, run at interpreter exit (with or without
    destroy_process_group), abort the process now and then ("terminate called without an
    active exception", about 1 run in 4 with 4 ranks on 2 cores), after all work is done.
    """
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def gather_to_rank0(obj):
    """Every rank's `obj` on rank 0 as {rank: obj}; None elsewhere."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return dict(enumerate(out)) if out is not None else None
