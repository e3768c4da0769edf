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


def max_cpu_ranks() -> int:
    """The most CPU ranks tpsim spawns without --force."""
    return max(8, os.cpu_count() or 1)


def is_reporting_process() -> bool:
    """The process that prints results: the launcher, or global rank 0 under torchrun."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world(world: int, device: str, force: bool) -> None:
    """Refuse a self-spawned world the machine should not run without --force."""
    if under_torchrun():
        return
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but CUDA is not available here; use --device cpu")
        return
    limit = max_cpu_ranks()
    if world > limit and not force:
        raise UsageError(f"--tp {world} would spawn {world} CPU ranks on a {os.cpu_count()}-core machine; "
                         f"the limit is {limit}: pass --force to run it anyway")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, what they are): host MemAvailable, or the least free memory of the visible GPUs."""
    if device == "cuda":
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        return free, f"free on each of the {torch.cuda.device_count()} GPU(s)"
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024, "available memory on this machine"


def check_memory(cfg, tps: list[int], dtype: str, device: str, force: bool, source: str) -> None:
    """Refuse, before any rank allocates, weights that would not fit: per GPU (the ranks that
    share one), or on the host (every self-spawned rank of the largest degree at once; under
    torchrun the ranks of this node, each at its largest shard)."""
    from tpsim.run.jobs import DTYPES
    from tpsim.model import shard_bytes
    if force or (device == "cpu" and not os.path.exists("/proc/meminfo")):
        return
    shard = {t: shard_bytes(cfg, t, DTYPES[dtype]) for t in tps}
    if device == "cuda":
        gpus = max(1, torch.cuda.device_count())
        per = {t: (1 if under_torchrun() else -(-t // gpus)) for t in tps}
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        per = {t: local if under_torchrun() else t for t in tps}
    t = max(tps, key=lambda t: per[t] * shard[t])
    need = per[t] * shard[t]
    have, where = available_memory(device)
    if need > have:
        ranks = f"{per[t]} rank{'s' if per[t] > 1 else ''} x {human_bytes(shard[t])}"
        raise UsageError(f"{source} needs {human_bytes(need)} of {dtype} weights at TP={t} ({ranks}) and there is "
                         f"{human_bytes(have)} {where}; use a larger --tp or more GPUs, --override "
                         "num_hidden_layers=N to truncate, or --force to try anyway")


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
