"""A rank process's ties to its launcher (Linux prctl): it dies with its parent, and `ps` names it.
Standard library only: the fork server imports tpsim before torch and installs the guard first."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def _prctl(option: int, arg) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6").prctl(option, arg) == 0
    except OSError:
        return False


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when its parent dies (Linux: the parent *thread*, so a launcher must start
    such a child from a thread that lives as long as it does); if the parent is no longer `parent_pid` (it died
    before the guard was in place, and the process was re-parented), exit now."""
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL) and parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def name_process(name: str) -> None:
    """The name `ps`, `top` and /proc/PID/comm show (at most 15 bytes): a forked rank would otherwise
    carry its launcher's name and command line."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
