"""`--server ENGINE@VERSION` -> the PD-disaggregation hand-off that version does (tpsim.profiles.pd), from
the engine's whole history of it (sglang.PD_HISTORY), which reaches before the model files' profiled range."""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.base.errors import UsageError
from tpsim.profiles import sglang
from tpsim.profiles.pd import PdTransfer, Widths
from tpsim.profiles.profile import Change, Cited, Versions
from tpsim.profiles.registry import ALIASES, when

OLDEST_READ = "0.5.1"  # the oldest wheel whose hand-off was read
FIXED_IN = "0.5.6"  # the first release read that has both PRs (their first releases are unknown)


@dataclass(frozen=True)
class PdVersion:
    """The hand-off of one engine version: its cited behaviour and the versions it holds for."""

    server: str
    cited: Cited[PdTransfer]
    versions: Versions
    changes: tuple[Change, ...]  # every change of the history (the fix names them)

    @property
    def transfer(self) -> PdTransfer:
        return self.cited.value

    def fix(self) -> str:
        prs = ", ".join(c.label for c in self.changes)
        return (f"serve with sglang {FIXED_IN} or later ({prs}; first release unknown: {FIXED_IN} is the first "
                "release tpsim read that has both)")

    def failure(self, w: Widths) -> str | None:
        """The engine's failure at these widths, in its words (None: the hand-off runs)."""
        return None if self.transfer.fits(w) else self.cited.error


def pd_version(server: str) -> PdVersion:
    """The hand-off `server` (`sglang[@VERSION][:MODEL]`) does (UsageError for an engine without one)."""
    spec = server.partition("+")[0].partition(":")[0]
    engine, _, version = spec.partition("@")
    engine = ALIASES.get(engine, engine)
    if engine != "sglang":
        raise UsageError(f"--server {server}: tpsim replays the PD-disaggregation hand-off of sglang only; give "
                         "--server sglang@VERSION")
    at = when(engine, version)
    if at.day is not None and at.day < sglang.RELEASES[OLDEST_READ]:
        raise UsageError(f"--server {server}: tpsim read SGLang's PD-disaggregation hand-off from {OLDEST_READ} on; "
                         f"give {OLDEST_READ} or later, a date, or 'latest'")
    base, changes = sglang.PD_HISTORY
    edges = (None, *changes, None)
    for i in range(len(changes), -1, -1):
        since = edges[i]
        if since is None or at.has(since, sglang.RELEASES):
            cited = base if since is None else since.changes["pd"]
            return PdVersion(server, cited, Versions(since, edges[i + 1]), changes)
    raise AssertionError("the base holds when no change does")
