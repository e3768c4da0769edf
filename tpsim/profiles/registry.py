"""Every known profile, and `ENGINE[@VERSION][:MODEL]` -> the profile that holds for it.

VERSION is a release (`0.5.12`, `v0.11.0`), a date (`2026-05-20`: the code as of that day),
`latest`, or `oldest` (the oldest profile known). A release is placed on the timeline by its publication date (RELEASES); a change is in
a release when the profile names that release, else when it was merged before the release date.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date

from tpsim.base.errors import UsageError
from tpsim.profiles import sglang, trainers, vllm
from tpsim.profiles.profile import Change, Line, Profile

LINES: tuple[Line, ...] = (*sglang.LINES, *vllm.LINES, *trainers.LINES)
RELEASES: dict[str, dict[str, date]] = {"sglang": sglang.RELEASES, "vllm": vllm.RELEASES,
                                        "specforge": trainers.RELEASES}
ENGINES = tuple(dict.fromkeys(line.engine for line in LINES))
ALIASES = {"hf": "transformers", "sglang-boundary": "sglang"}


def all_profiles() -> list[Profile]:
    return [p for line in LINES for p in line.profiles()]


@dataclass(frozen=True)
class When:
    """A point on an engine's timeline: a release (with its date) or a date."""

    text: str
    day: date | None  # None: latest
    release: tuple[int, ...] | None = None

    def has(self, change: Change, releases: dict[str, date]) -> bool:
        """Whether the code at this point contains `change`."""
        if self.day is None:
            return True
        if change.release is not None:
            if self.release is not None:
                return self.release >= version_key(change.release)
            return change.release in releases and releases[change.release] <= self.day
        return change.merged is not None and change.merged <= self.day


def version_key(text: str) -> tuple[int, ...]:
    """`0.5.12.post1` -> (0, 5, 12, 1); `v0.11.0rc1` -> (0, 11, 0, -1) (an rc before its release)."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:\.?(post|rc)(\d+))?", text.strip())
    if not m:
        raise ValueError(text)
    parts = tuple(int(x) for x in m.group(1).split("."))
    parts = parts + (0,) * (3 - len(parts))
    if m.group(2) == "post":
        return parts + (int(m.group(3)) + 1,)
    if m.group(2) == "rc":
        return parts + (-100 + int(m.group(3)),)
    return parts + (0,)


def _when(engine: str, text: str) -> When:
    if text in ("", "latest", "main"):
        return When("latest", None)
    if text == "oldest":
        return When(text, date.min)
    releases = RELEASES.get(engine, {})
    try:
        return When(text, date.fromisoformat(text))
    except ValueError:
        pass
    try:
        key = version_key(text)
    except ValueError:
        raise UsageError(f"version {text!r} of {engine} is neither a release (e.g. 0.5.12), a date "
                         "(YYYY-MM-DD) nor 'latest'") from None
    known = {version_key(v): (v, d) for v, d in releases.items()}
    if key in known:
        return When(text, known[key][1], key)
    if not known:
        raise UsageError(f"{engine} has no numbered releases tpsim knows of; give a date "
                         f"(e.g. {engine}@2026-07-01) or 'latest'")
    lo, hi = min(known), max(known)
    if not lo <= key <= hi:
        raise UsageError(f"{engine} {text} is outside the known range {known[lo][0]} .. {known[hi][0]}; "
                         f"give a version in that range, a date, or 'latest'")
    before = max(k for k in known if k <= key)  # an unlisted version between two known ones
    return When(text, known[before][1], key)


def lookup(text: str, model_type: str) -> Profile:
    """`ENGINE[@VERSION][:MODEL]` -> its profile; MODEL defaults to `model_type` (the target's)."""
    spec, _, model = text.strip().partition(":")
    engine, _, version = spec.partition("@")
    engine = ALIASES.get(engine, engine)
    if engine not in ENGINES:
        raise UsageError(f"unknown profile {text!r}: no engine {engine!r}; use one of {', '.join(ENGINES)} "
                         "(tpsim profiles lists every profile)")
    lines = [line for line in LINES if line.engine == engine]
    model = model or model_type
    line = next((ln for ln in lines if model in (ln.family, *ln.models)), None) or \
        next((ln for ln in lines if not ln.models), None)  # a model-agnostic trainer
    if line is None:
        covered = sorted({m for ln in lines for m in (ln.family, *ln.models)})
        raise UsageError(f"profile {text!r}: {engine} has no profile for model {model!r}; it covers "
                         f"{', '.join(covered)}")
    when = _when(engine, version)
    releases = RELEASES.get(engine, {})
    if line.starts is not None and not when.has(line.starts, releases):
        first = line.starts.release or line.starts.merged
        raise UsageError(f"profile {text!r}: {engine}:{line.family} is profiled from {first} on "
                         f"({line.starts.title}); {version} is older: give {first} or later")
    for p in reversed(line.profiles()):  # the newest interval whose opening change this code has
        if p.versions.since is None or when.has(p.versions.since, releases):
            return p
    raise AssertionError("the oldest profile has no opening change")


def names() -> list[str]:
    return [p.name for p in all_profiles()]


def later_profiles(p: Profile) -> list[Profile]:
    """The profiles of the same engine and model file after `p`, oldest first."""
    line = next(ln for ln in LINES if ln.engine == p.engine and ln.family == p.family)
    every = line.profiles()
    return every[[q.name for q in every].index(p.name) + 1:]
