"""Ranks started by torchrun: its environment checked, the world joined (env rendezvous) with
tpsim.parallel.launch's TP groups, results gathered on rank 0, and a rank's clean exit."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpsim.base.errors import UsageError
from tpsim.parallel.launch import RankContext, build_groups, default_backend


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and "LOCAL_RANK" in os.environ)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_torchrun_env() -> None:
    """torchrun's variables, all or none and well formed, before anything tries to join its
    rendezvous (one line naming the missing or bad one, not a traceback from init_process_group)."""
    given = [v for v in TORCHRUN_VARS[:3] if v in os.environ]
    if not given:
        return
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise UsageError(f"{', '.join(given)} set but {', '.join(missing)} not: a partial torchrun environment; "
                         f"launch with torchrun, or unset {', '.join(given)}")
    values = {v: os.environ[v] for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    bad = [f"{v}={x!r}" for v, x in values.items() if not x.isdecimal()]
    if not bad and int(values["WORLD_SIZE"]) < 1:
        bad = [f"WORLD_SIZE={values['WORLD_SIZE']!r}"]
    if not bad and int(values["RANK"]) >= int(values["WORLD_SIZE"]):
        bad = [f"RANK={values['RANK']} with WORLD_SIZE={values['WORLD_SIZE']}"]
    if bad:
        raise UsageError(f"torchrun environment: {bad[0]} is not valid (non-negative integers, RANK < WORLD_SIZE); "
                         "launch with torchrun")



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
