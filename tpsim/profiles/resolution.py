"""A Resolution: what a convention or a profiled engine does with some ids, as `resolve`, `check`
and `capture` print and record it; `resolution` makes one from a replay, for both."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpsim.capture.positions import Position
from tpsim.profiles.findings import Finding
from tpsim.profiles.fingerprints import Unverified
from tpsim.profiles.replay import Replay


@dataclass
class Resolution:
    """What a convention (or profile) does with some ids on a model of `num_layers` layers."""

    convention: str  # a convention's name or a profile's
    num_layers: int
    ids: list[int] | None  # as written; None = the convention's default
    internal: list[int]  # the engine's own list (e.g. SGLang's layers_to_capture)
    internal_name: str
    positions: list[Position]  # in concatenation order
    notes: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)  # what the engine's handling breaks (with --server)
    failed: bool = False  # the engine crashes or refuses: nothing is captured
    unverified: Unverified | None = None  # a --server release where the cited code changed since it was read

    @property
    def positions_text(self) -> str:
        return ",".join(map(str, self.positions))

    def to_dict(self) -> dict:
        return {"convention": self.convention, "num_layers": self.num_layers, "ids": self.ids,
                "used_default": self.ids is None, self.internal_name: self.internal,
                "positions": [str(p) for p in self.positions], "notes": self.notes,
                "findings": [str(f) for f in self.findings],
                "failed": self.failed, "unverified": self.unverified and self.unverified.to_dict()}


def resolution(rep: Replay, given: list[int] | None, name: str | None = None, internal: list[int] | None = None,
               internal_name: str = "internal_ids", notes: list[str] | None = None) -> Resolution:
    """The replay as a Resolution: by default the profile's name, the ids its loop tests and its
    notes; a convention passes its own name, list and notes."""
    return Resolution(rep.profile.name if name is None else name, rep.num_layers,
                      None if given is None else list(given),
                      [s.internal for s in rep.slots] if internal is None else internal, internal_name,
                      list(rep.positions), list(rep.notes) + list(rep.profile.notes) if notes is None else notes)
