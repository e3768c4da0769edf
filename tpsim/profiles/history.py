"""One engine behaviour over its releases where it lives outside the model files' lines (the PD hand-off, the
radix cache's keys, the hidden states `return_hidden_states` gives back): the oldest value read and the `Change`s
that altered it, and `--server ENGINE@VERSION` -> the value in force there. Such a history may reach before the
model files' profiled range; before its own oldest release read it claims nothing (a version there is refused)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Generic, TypeVar

from tpsim.base.errors import UsageError
from tpsim.profiles import sglang_server
from tpsim.profiles.cited import Change, Cited, Versions
from tpsim.profiles.registry import ALIASES, when

T = TypeVar("T")


@dataclass(frozen=True)
class History(Generic[T]):
    engine: str
    what: str  # the behaviour, for messages ("the PD-disaggregation hand-off")
    key: str  # the name each Change's `changes` holds its value under
    base: Cited[T]  # the value of the oldest release read
    changes: tuple[Change, ...]
    oldest: str  # the oldest release read
    releases: dict[str, date]

    def read(self, server: str) -> bool:
        """Whether `server`'s version is one this history read (not older than its oldest release read)."""
        return self._read(when(self.engine, ServerName.of(server).version))

    def _read(self, day) -> bool:
        return day.day is None or day.day >= self.releases[self.oldest]

    def at(self, server: str) -> "Held[T]":
        """The value `server` (`ENGINE[@VERSION][:MODEL][+PATCH]`) has (UsageError: another engine, or a version
        older than the oldest release read)."""
        name = ServerName.of(server)
        if name.engine != self.engine:
            raise UsageError(f"--server {server}: tpsim replays {self.what} of {self.engine} only; give --server "
                             f"{self.engine}@VERSION")
        day = when(self.engine, name.version)
        if not self._read(day):
            raise UsageError(f"--server {server}: tpsim read {self.what} of {self.engine} from {self.oldest} on; give "
                             f"{self.oldest} or later, a date, or 'latest'")
        edges = (None, *self.changes, None)
        for i in range(len(self.changes), -1, -1):
            since = edges[i]
            if since is None or day.has(since, self.releases):
                cited = self.base if since is None else since.changes[self.key]
                return Held(server, cited, Versions(since, edges[i + 1]), self)
        raise AssertionError("the base holds when no change does")


@dataclass(frozen=True)
class Held(Generic[T]):
    """The value one engine version has, and the versions it holds for."""

    server: str
    cited: Cited[T]
    versions: Versions
    history: History[T]

    @property
    def value(self) -> T:
        return self.cited.value

    def later(self, ok) -> Change | None:
        """The first change after this version whose value satisfies `ok`."""
        after = self.history.changes if self.versions.since is None else \
            self.history.changes[self.history.changes.index(self.versions.since) + 1:]
        return next((c for c in after if ok(c.changes[self.history.key].value)), None)

    @staticmethod
    def upgrade(change: Change) -> str:
        """`sglang 0.5.3 or later (#10846)`, or the merge date where the first release is unknown."""
        when_ = change.release or f"code merged after {change.merged} (first release unknown)"
        return f"{when_} or later ({change.label})" if change.prs else f"{when_} or later"


@dataclass(frozen=True)
class ServerName:
    """`ENGINE[@VERSION][:MODEL][+PATCH]` in its parts (the engine's alias resolved)."""

    engine: str
    version: str
    model: str
    patch: str

    @staticmethod
    def of(text: str) -> "ServerName":
        base, _, patch = text.partition("+")
        head, _, model = base.partition(":")
        engine, _, version = head.partition("@")
        return ServerName(ALIASES.get(engine, engine), version, model, patch)

    def at(self, version: str) -> str:
        """The same name at another version."""
        return f"{self.engine}@{version}" + (f":{self.model}" if self.model else "") + \
            (f"+{self.patch}" if self.patch else "")


def model_file_server(server: str, what: str) -> tuple[str, str | None]:
    """The --server whose model file replays the capture, and a note when it is not `server`: an SGLang version
    before the model files' profiled range is captured as the oldest profiled release (`what`: the behaviour the
    version keeps as its own, e.g. "the PD hand-off")."""
    name, first = ServerName.of(server), sglang_server.OLDEST.release
    at = when(name.engine, name.version) if name.engine == "sglang" else None
    if at is None or at.day is None or at.day >= sglang_server.RELEASES[first]:
        return server, None
    return (name.at(first),
            f"the capture is replayed as {name.engine}@{first}'s model file (tpsim read the model files from {first} "
            f"on; {name.version}'s capture loop was not read); {name.version}'s own: {what}")
