"""Other processes as Linux's /proc shows them: what the watchdog, the torchrun peer check and the
tests' leftover search read (one parser of /proc/PID/stat; None or nothing where there is no /proc)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat tpsim reads (proc(5))."""

    pid: int
    state: str  # "Z": a zombie, dead and not yet reaped
    ppid: int
    session: int
    cpu_s: float  # user + system CPU seconds used so far


def proc_stat(pid: int) -> ProcStat | None:
    """Process `pid`'s stat (None when it is gone or there is no /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()  # after "(comm)", which may hold spaces
    except (OSError, TypeError):
        return None
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[3]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)


def all_procs() -> Iterator[ProcStat]:
    """Every live process's stat (nothing without /proc)."""
    root = Path("/proc")
    for d in root.iterdir() if root.is_dir() else ():
        if d.name.isdecimal():
            stat = proc_stat(int(d.name))
            if stat is not None:
                yield stat
