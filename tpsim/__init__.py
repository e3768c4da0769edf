"""tpsim: which tensor a tensor-parallel engine captures for an EAGLE-3 draft model."""

import os as _os

__version__ = "0.1.0"

# A self-spawned rank (RankPool sets TPSIM_LAUNCHER_PID to the launcher's pid in its environment)
# dies with the launcher from its first instruction: the spawn child imports tpsim before torch,
# and a launcher SIGKILLed while its ranks still import torch left them orphaned, blocked on a
# pipe. Every spawned rank imports tpsim before it runs its worker, so this is the one place the
# guard is installed; it must stay free of imports that take time.
if _os.environ.get("TPSIM_LAUNCHER_PID", "") not in ("", str(_os.getpid())):
    import signal as _signal

    from tpsim.parallel.deathsig import die_with_launcher as _die

    _die(int(_os.environ["TPSIM_LAUNCHER_PID"]))
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # Ctrl-C is the launcher's to handle: it stops the ranks
