"""Tie a process's life to its launcher's (Linux: PR_SET_PDEATHSIG). Standard library only: it
runs in a spawned rank before torch is imported."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_launcher(launcher_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies; if the parent (the launcher `launcher_pid`) is
    already gone, exit now (the death came before the guard)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if launcher_pid is not None and os.getppid() != launcher_pid:
        os._exit(1)
