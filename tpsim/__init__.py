"""tpsim: which tensor a tensor-parallel engine captures for an EAGLE-3 draft model."""

import os as _os

__version__ = "0.1.0"

# The rank pool's fork server (RankPool sets TPSIM_LAUNCHER_PID to the launcher's pid in the
# environment it starts with) dies with the launcher from its first instruction: it imports tpsim
# before torch, and a launcher SIGKILLed while a child still imported torch left it orphaned,
# blocked on a pipe. Ranks forked from it tie their lives to it (RankPool's worker). It must stay
# free of imports that take time.
if _os.environ.get("TPSIM_LAUNCHER_PID", "") not in ("", str(_os.getpid())):
    import signal as _signal

    from tpsim.parallel.deathsig import die_with_parent as _die

    _die(int(_os.environ["TPSIM_LAUNCHER_PID"]))
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # Ctrl-C is the launcher's to handle: it stops the ranks
