"""The launch environment, read before anything else and without torch (`tpsim --help` imports
none): torchrun's variables (tpsim.parallel.torchrun joins the world they describe), which process
reports, and TPSIM_RANK_START (how tpsim.parallel.pool starts its ranks)."""

from __future__ import annotations

import enum
import os
from pathlib import Path

from tpsim.base.errors import UsageError
from tpsim.base.procs import all_procs


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


def is_reporting_process() -> bool:
    """The process that prints results: the launcher, or global rank 0 under torchrun."""
    return not under_torchrun() or os.environ.get("RANK", "0") == "0"


def dead_local_peers() -> list[int]:
    """The global ranks of this torchrun node whose processes are gone (torchrun's agent is the
    parent of every local rank: a sibling missing, or a zombie, has died)."""
    try:
        me, local, size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return []
    parent, alive = os.getppid(), set()
    for proc in all_procs():
        if proc.ppid != parent or proc.state == "Z":
            continue
        try:
            environ = Path(f"/proc/{proc.pid}/environ").read_text().split("\0")
            alive.add(int(dict(kv.split("=", 1) for kv in environ if "=" in kv).get("RANK", "-1")))
        except (OSError, ValueError):
            continue
    first = me - local
    return [r for r in range(first, first + size) if r != me and r not in alive]


class StartMethod(enum.Enum):
    """How a pool's ranks come to life. Both pay torch's import (~2 s of CPU) once per launcher, not
    once per rank: FORK copies the launcher, which has imported torch and tpsim already; FORKSERVER
    forks from a server that imported them once (multiprocessing's forkserver, tpsim preloaded) and
    serves every later pool of the process."""

    FORK = "fork"
    FORKSERVER = "forkserver"


START_ENV = "TPSIM_RANK_START"  # fork or forkserver: overrides tpsim.parallel.pool.start_method's choice


def asked_start_method() -> StartMethod | None:
    """The start method TPSIM_RANK_START asks for (None: unset, the pool chooses)."""
    env = os.environ.get(START_ENV)
    if not env:
        return None
    try:
        return StartMethod(env)
    except ValueError:
        raise UsageError(f"{START_ENV}={env!r} is not one of fork, forkserver; fix it or unset {START_ENV}") from None
