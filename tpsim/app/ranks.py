"""Run a job on real ranks: under torchrun when launched by it, else a self-started pool."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable

import torch

from tpsim.base.environ import dead_local_peers, is_reporting_process
from tpsim.base.errors import RankError, UsageError
from tpsim.base.ui import ProgressLine
from tpsim.parallel.launch import default_backend
from tpsim.parallel.pool import RankPool, peer_symptom
from tpsim.parallel.torchrun import gather_to_rank0, init_from_env, under_torchrun
from tpsim.run.spec import RunSpec

_TORCHRUN_CTX = None


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
            me, report = _TORCHRUN_CTX.rank, traceback.format_exc()
            gone = []
            for _ in range(10 if peer_symptom(report) else 0):  # the dead peer's exit may lag its socket's close
                gone = dead_local_peers()
                if gone:
                    break
                time.sleep(0.1)
            if gone:  # the root cause, as the self-started pool names it, not this rank's lost connection
                raise RankError(f"rank {gone[0]} died (its process is gone) while running {job.__name__}; rank {me} "
                                f"then failed: {e.__class__.__name__}: {str(e).splitlines()[0][:200]}\n{report}") from e
            raise RankError(f"rank {me} failed while running {job.__name__}: "
                            f"{e.__class__.__name__}: {e}\n{report}") from e
        return gather_to_rank0(result)
    backend = pick_backend(device, backend, world)
    with RankPool(world, backend, device, timeout_s, on_progress=progress) as pool:
        return pool.run(job, **kwargs)


def on_ranks(job: Callable, spec: RunSpec, world: int, **kwargs) -> dict | None:
    """`job(ctx, spec=spec, **kwargs)` on `world` ranks as `spec` says (device, backend, timeout),
    with the progress line on the reporting process."""
    progress = ProgressLine(enabled=is_reporting_process())
    try:
        return run_on_ranks(job, world, device=spec.device, backend=spec.backend, timeout_s=spec.timeout_s,
                            progress=progress, spec=spec, **kwargs)
    finally:
        progress.stop()
