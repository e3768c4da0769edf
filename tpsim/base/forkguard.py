"""The rank pool's fork server ties its life to the launcher's on import, before anything else.

RankPool starts the server with TPSIM_LAUNCHER_PID in its environment and preloads this module first
(before tpsim.parallel.pool, which imports torch): a launcher SIGKILLed while the server still imported
torch left it orphaned, blocked on a pipe. Ranks forked from the server tie their lives to it
(RankPool's worker). Standard library only. In any other process (the launcher itself, the variable
unset) importing it does nothing."""

from __future__ import annotations

import os
import signal

from tpsim.base.deathsig import die_with_parent

LAUNCHER_ENV = "TPSIM_LAUNCHER_PID"


def guard() -> bool:
    """Die with the launcher and leave Ctrl-C to it, if this process was started for one (True)."""
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher in ("", str(os.getpid())):
        return False
    die_with_parent(int(launcher))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle: it stops the ranks
    return True


guard()
