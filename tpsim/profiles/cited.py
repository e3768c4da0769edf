"""What tpsim read of an engine and when it changed: a `Source` (repo, path, ref, the code quoted), a
behaviour `Cited` from one, the `Change` a PR made, the `Versions` a profile holds for, and a release list's
dates. The profiles (tpsim.profiles.profile) and every cited table (loaders, prefix, ubatch, ...) build on it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """Where a behaviour is shown: `ref` is a commit (hex), a release tag (`v0.5.12`) or a PR (`#123`); `note`
    paraphrases it; `symbol` is the qualified name of the function or class read in `path` (what the source
    fingerprints hash, docs/profiles.md); `quote` is a few lines of that code as it was read; `reviewed`: the
    releases where the symbol's code differs from `ref`'s and was read too, the behaviour unchanged."""

    repo: str
    path: str
    ref: str
    note: str = ""
    symbol: str = ""
    quote: str = ""
    reviewed: tuple[str, ...] = ()  # later releases whose changed `symbol` was read: the behaviour holds there

    def __str__(self) -> str:
        where = f"{self.repo} {self.path}" if self.path else self.repo
        ref = f"PR {self.ref}" if self.ref.startswith("#") else f"@{self.ref}"
        return f"{where} {ref}"


@dataclass(frozen=True)
class Cited(Generic[T]):
    """A behaviour and the source it was read from (`error`: the engine's words where the value refuses or fails)."""

    value: T
    source: Source
    error: str = ""  # a refusal or a failure: the engine's own words ({i} of {n}, {architecture}: filled in)


@dataclass(frozen=True)
class Change:
    """A PR that changed some behaviours: merged on `merged`, first in release `release` (None:
    unknown or not released yet; the profile says so)."""

    prs: tuple[str, ...]  # "#123" for a PR, a commit hash where there is no PR; () where neither is known
    title: str
    merged: date | None
    release: str | None
    changes: dict[str, Cited]

    @property
    def label(self) -> str:
        return ", ".join(self.prs)


@dataclass(frozen=True)
class Versions:
    """The versions a profile holds for: from `since` (None: the oldest known) until `until`
    (None: the newest known)."""

    since: Change | None
    until: Change | None

    def text(self) -> str:
        def edge(c: Change, word: str) -> str:
            if not c.prs:
                return f"{word} release {c.release}"
            rel = f"release {c.release}" if c.release else "first release unknown"
            when = f", merged {c.merged}" if c.merged else ""
            return f"{word} {c.label} ({rel}{when})"
        parts = ([edge(self.since, "from")] if self.since else []) + ([edge(self.until, "before")] if self.until else [])
        return "; ".join(parts) if parts else "every known version"

    def span(self) -> str:
        """`0.5.7 .. 0.5.11`: the first release it holds for and the first it no longer does."""
        def at(c: Change) -> str:
            return c.release or (str(c.merged) if c.merged else c.label)
        return f"{at(self.since) if self.since else 'oldest'} .. {at(self.until) if self.until else 'latest'}"


def releases(text: str) -> dict[str, date]:
    """`"0.5.12 2026-05-16, 0.5.13 2026-06-11"` -> {version: publication date}."""
    out = {}
    for item in text.split(","):
        version, day = item.split()
        out[version] = date.fromisoformat(day)
    return out
