"""What each rank is doing, and injected faults for drills and tests.

`doing(text)` records a rank's current activity ("all_reduce in model.layers.2.self_attn.o_proj")
in a small shared-memory slot the launcher reads when the rank dies or stalls, so the error
names the layer and collective, not just the rank.

`TPSIM_FAULT=RANK:WHERE:HOW` makes global rank RANK fail at WHERE: `startup` (before joining
the process group), a collective's caller module (`model.embed_tokens`,
`model.layers.2.self_attn.o_proj`, ...: just before that collective), or `write` (the
launcher, between writing an output file's temporary copy and renaming it; RANK is ignored).
HOW is `raise` (an exception), `kill` (SIGKILL, no goodbye) or `stall` (sleep forever).
"""

from __future__ import annotations

import errno
import os
import signal
import time

from tpsim.base.errors import UsageError

ENV = "TPSIM_FAULT"
HOWS = ("raise", "kill", "stall")
SLOT_BYTES = 200

_slot = None  # this rank's multiprocessing Array('c'), set by the pool worker


def install(slot) -> None:
    global _slot
    _slot = slot


def doing(text: str) -> None:
    if _slot is not None:
        _slot.value = text.encode()[:SLOT_BYTES - 1]


def read(slot) -> str:
    return slot.value.decode(errors="replace")


def _parse() -> tuple[int | None, str, str] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    rank, _, rest = spec.partition(":")
    where, _, how = rest.rpartition(":")
    if how not in HOWS or not where or not (rank in ("", "*", "launcher") or rank.isdecimal()):
        raise UsageError(f"{ENV}={spec!r} is not RANK:WHERE:HOW (RANK a number, *, or launcher; HOW one of "
                         f"{', '.join(HOWS)}), e.g. {ENV}=1:model.embed_tokens:raise; fix it or unset {ENV}")
    return (None if rank in ("", "*", "launcher") else int(rank)), where, how


def check() -> None:
    """Refuse a malformed TPSIM_FAULT before any rank starts (one line, exit 2)."""
    _parse()


def at(where: str, rank: int | None = None) -> None:
    """Fail here if TPSIM_FAULT names this place (and this rank)."""
    fault = _parse()
    if fault is None or fault[1] != where or (fault[0] is not None and rank is not None and fault[0] != rank):
        return
    how = fault[2]
    if how == "raise" and where == "write":
        raise OSError(errno.EIO, "injected I/O error while writing")
    if how == "raise":
        raise RuntimeError(f"injected fault at {where}")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)
