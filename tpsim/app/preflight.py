"""What is checked before any rank starts: the world the machine can run, the memory the
weights need, the collective timeout, the torchrun world, the files a command writes."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import torch

from tpsim.base.atomic import temporary_name
from tpsim.base.errors import UsageError
from tpsim.model.decoder import shard_bytes
from tpsim.parallel.torchrun import under_torchrun
from tpsim.run.jobs import DTYPES
from tpsim.base.ui import human_bytes


def torchrun_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


IGNORE_LIMITS = "pass --ignore-limits to run it anyway"  # every guard's way past it, in the same words
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # far above any collective's need; 1e10 s overflows the backends' timers


def check_timeout(seconds: float) -> None:
    if not 0 < seconds <= MAX_TIMEOUT_S:  # also rejects nan and inf
        raise UsageError(f"--timeout {seconds:g} must be a positive, finite number of seconds up to "
                         f"{MAX_TIMEOUT_S:.0f} (a week), e.g. 60")


def check_divides_world(tp: int) -> None:
    """Under torchrun, a TP degree must divide the world (one group per block of ranks)."""
    if under_torchrun() and torchrun_world() % tp:
        raise UsageError(f"--tp {tp} does not divide the torchrun world size {torchrun_world()}; "
                         f"use degrees that divide {torchrun_world()}")


def max_cpu_ranks() -> int:
    """The most CPU ranks tpsim spawns without --ignore-limits."""
    return max(8, os.cpu_count() or 1)


def check_world(world: int, device: str, ignore_limits: bool, what: str | None = None) -> None:
    """Refuse a self-spawned world the machine should not run without --ignore-limits (`what`: the
    options that ask for it, default `--tp {world}`)."""
    if under_torchrun():
        return
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda but CUDA is not available here; use --device cpu")
        return
    limit = max_cpu_ranks()
    if world > limit and not ignore_limits:
        raise UsageError(f"{what or f'--tp {world}'} would spawn {world} CPU ranks on a {os.cpu_count()}-core machine; "
                         f"the limit is {limit}: {IGNORE_LIMITS}")


def address_space_left() -> int | None:
    """What RLIMIT_AS (ulimit -v) leaves a process like this one, which a rank inherits (None: no
    limit). A rank maps what this process maps (Python, torch) before its weights."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        size = 0
    return max(0, soft - size)


def available_memory(device: str) -> tuple[int, str]:
    """(bytes, what they are): host MemAvailable, or the least free memory of the visible GPUs."""
    if device == "cuda":
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        return free, f"free on each of the {torch.cuda.device_count()} GPU(s)"
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024, "available memory on this machine"


def check_memory(cfg, tps: list[int], dtype: str, device: str, ignore_limits: bool, source: str,
                 whole: bool = False) -> None:
    """Refuse, before any rank allocates, weights that would not fit: per GPU (the ranks that
    share one), or on the host (every self-spawned rank of the largest degree at once; under
    torchrun the ranks of this node, each at its largest shard). `whole`: every rank holds the
    whole model (context parallelism)."""
    if ignore_limits or (device == "cpu" and not os.path.exists("/proc/meminfo")):
        return
    shard = {t: shard_bytes(cfg, 1 if whole else t, DTYPES[dtype]) for t in tps}
    if cfg.fp8_block is not None:  # the linear weights in fp8, the rest (embedding, head, norms, router) in dtype
        dtype = f"fp8 ({cfg.fp8_block[0]}x{cfg.fp8_block[1]}-block) and {dtype}"
    if device == "cuda":
        gpus = max(1, torch.cuda.device_count())
        per = {t: (1 if under_torchrun() else -(-t // gpus)) for t in tps}
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        per = {t: local if under_torchrun() else t for t in tps}
    largest = max(shard.values())  # each rank is a process: its shard must fit under ulimit -v
    left = address_space_left()
    if device == "cpu" and left is not None and largest > left:
        raise UsageError(f"{source} needs {human_bytes(largest)} of {dtype} weights in one rank at TP={min(tps)} and "
                         f"the address-space limit (ulimit -v) leaves each process {human_bytes(left)}; raise "
                         "ulimit -v, use a larger --tp, --override num_hidden_layers=N to truncate, or --ignore-limits")
    t = max(tps, key=lambda t: per[t] * shard[t])
    need = per[t] * shard[t]
    how = f"at TP={t} ({per[t]} rank{'s' if per[t] > 1 else ''} x {human_bytes(shard[t])})"
    if device == "cpu" and not under_torchrun() and len(tps) > 1:  # the pool's ranks run their degrees at
        # once: rank r holds the largest shard among the degrees it takes part in (r < tp)
        need = sum(max(shard[t] for t in tps if r < t) for r in range(max(tps)))
        how = f"for TP {','.join(map(str, sorted(tps)))} side by side (rank 0 alone holds {human_bytes(shard[min(tps)])})"
    have, where = available_memory(device)
    if need > have:
        raise UsageError(f"{source} needs {human_bytes(need)} of {dtype} weights {how} and there is "
                         f"{human_bytes(have)} {where}; use a larger --tp or more GPUs, --override "
                         "num_hidden_layers=N to truncate, or --ignore-limits to try anyway")


def check_output(out: Path, option: str, example: str, force: bool, reads: tuple[Path, ...] = ()) -> None:
    """An output tpsim may write: a regular file or a new name in a writable directory, with the
    suffix of its format (that of `example`), replaced only with --force, and never a file the run reads
    (`reads`: its inputs' files or directories, which --force does not make outputs)."""
    suffix = Path(example).suffix
    for given in reads:
        read = given.resolve()
        if out.resolve() == read or (read.is_dir() and read in out.resolve().parents):
            where = f"is inside {given}" if read.is_dir() else f"would replace {given}"
            raise UsageError(f"{option} {out} {where}, which this run reads; give a name outside it")
    if not out.parent.is_dir():
        raise UsageError(f"{option} {out}: directory {out.parent} does not exist; create it first")
    if out.is_symlink():  # replacing it would replace the link, not what it points to: say which is meant
        raise UsageError(f"{option} {out} is a symbolic link; give the path it points to ({out.resolve()}) or a new name")
    if out.is_dir():
        raise UsageError(f"{option} {out} is a directory; give a file name like {out / example}")
    if out.exists() and not out.is_file():
        raise UsageError(f"{option} {out} is not a regular file (a FIFO, a device or a socket); give a file name")
    if out.suffix != suffix:  # safetensors under a .pt name fails torch.load
        raise UsageError(f"{option} {out}: tpsim writes {suffix[1:]} here; name it {out.with_suffix(suffix).name}")
    if out.exists() and not force:
        raise UsageError(f"{option} {out} exists; pass --force to replace it, or give a new name")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"{option} {out}: directory {out.parent} is not writable")
    need, limit = len(temporary_name(out).encode()), os.pathconf(out.parent, "PC_NAME_MAX")
    if need > limit:
        raise UsageError(f"{option} {out.name[:40]}...: the name is too long for the temporary file written beside "
                         f"it ({need} of {limit} bytes); use a name of at most "
                         f"{limit - (need - len(out.name.encode()))} bytes")
