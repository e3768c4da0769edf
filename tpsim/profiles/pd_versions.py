"""`--server ENGINE@VERSION` -> the PD-disaggregation hand-off that version does (tpsim.profiles.pd), from
the engine's whole history of it (sglang.PD_HISTORY), which reaches before the model files' profiled range."""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.profiles import sglang
from tpsim.profiles.pd import PdTransfer, Widths
from tpsim.profiles.profile import Change, Cited, Versions
from tpsim.profiles.history import History

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


PD = History("sglang", "the PD-disaggregation hand-off", "pd", sglang.PD_HISTORY[0], sglang.PD_HISTORY[1],
             OLDEST_READ, sglang.RELEASES)


def pd_version(server: str) -> PdVersion:
    """The hand-off `server` (`sglang[@VERSION][:MODEL]`) does (UsageError for an engine without one)."""
    held = PD.at(server)
    return PdVersion(server, held.cited, held.versions, PD.changes)
