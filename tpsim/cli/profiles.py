"""`tpsim profiles`: every engine profile, the versions it holds for, how it differs from that
engine's latest profile for the same model file, and its sources; per line, every release classified by
the source fingerprints (read, unchanged since a release read, changed and unread, absent, unknown)."""

from __future__ import annotations

import textwrap

from tpsim.cli.options import emit_json
from tpsim.profiles import fingerprints, registry
from tpsim.profiles.fingerprints import Classified, Status
from tpsim.profiles.cited import Source
from tpsim.profiles.history import ServerName
from tpsim.profiles.profile import Behaviour, Line, Profile, describe, differences
from tpsim.base.errors import UsageError
from tpsim.base.ui import say, table


def entries() -> list[tuple[Profile, Profile]]:
    """(profile, the latest profile of its line) for every profile, oldest first per line."""
    out = []
    for line in registry.LINES:
        ps = line.profiles()
        out += [(p, ps[-1]) for p in ps]
    return out


def classified() -> dict[tuple[str, str], list[Classified]]:
    """(engine, family) -> every release of that line, classified."""
    return {(ln.engine, ln.family): fingerprints.classify_line(ln) for ln in registry.LINES}


def _source(s: Source) -> dict:
    return {"source": str(s), "note": s.note, "symbol": s.symbol or None, "quote": s.quote or None}


def to_dict(p: Profile, latest: Profile, releases: list[Classified]) -> dict:
    v = p.versions
    return {"name": p.name, "engine": p.engine, "family": p.family, "models": list(p.models) or ["any"],
            "versions": {"text": v.text(), "since": v.since and _edge(v.since), "until": v.until and _edge(v.until)},
            "behaviour": {f: {"value": describe(c), **_source(c.source)}
                          for f in Behaviour.FIELDS if (c := getattr(p.behaviour, f)) is not None},
            "differs_from_latest": differences(p, latest), "latest": p.name == latest.name,
            "sources": [str(s) for s in p.sources()], "notes": list(p.notes),
            "releases": [c.to_dict() for c in releases if c.profile.name == p.name]}


def _edge(c) -> dict:
    return {"prs": list(c.prs), "title": c.title, "merged": c.merged and c.merged.isoformat(), "release": c.release}


def runs(items: list[Classified], status: Status) -> str:
    """The releases of one status as ranges of consecutive releases: `0.5.6..0.5.7, 0.5.12`."""
    out, run = [], []
    for c in [*items, None]:
        if c is not None and c.status is status:
            run.append(c.release)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else f"{run[0]}..{run[-1]}")
        run = []
    return ", ".join(out)


def line_summary(items: list[Classified]) -> str:
    """`read 0.5.6; same 0.5.7..0.5.13; changed 0.5.14 (deepseek_v2.X)`: every status that occurs."""
    if not items:
        return "no numbered releases tpsim knows of: versions are dates"
    parts = []
    for status in (Status.READ, Status.SAME, Status.CHANGED, Status.ABSENT, Status.UNKNOWN):
        text = runs(items, status)
        if not text:
            continue
        named = sorted({v.key.short for c in items for v in c.verdicts if v.status is status})
        detail = f" ({', '.join(named)})" if status in (Status.CHANGED, Status.ABSENT) else ""
        parts.append(f"{status.name.lower()} {text}{detail}")
    if not any(c.verdicts for c in items):
        parts.append("no cited source names a symbol to fingerprint")
    unread = sorted({v.key.short for c in items for v in c.verdicts if v.read is None})
    if unread:
        parts.append(f"read at a commit or a PR, not compared: {', '.join(unread)}")
    return "; ".join(parts)


def wrapped(text: str, indent: int = 6) -> str:
    """`text` in lines of at most 100 columns, the later ones indented."""
    return "\n".join(textwrap.wrap(text, 100, subsequent_indent=" " * indent, break_on_hyphens=False))


def print_sources(rows: list[tuple[Profile, Profile]], by_line: dict, header: bool = True) -> None:
    for p, _ in rows:
        mine = [c for c in by_line.get((p.engine, p.family), []) if c.profile.name == p.name]
        if header:
            say(f"\n{p.name}")
        if mine and header:
            say(wrapped(f"  releases: {line_summary(mine)}"))
        for f in Behaviour.FIELDS:
            c = getattr(p.behaviour, f)
            if c is None:
                continue
            s = c.source
            say(f"  {f}: {describe(c)}\n    {s}{f' {s.symbol}' if s.symbol else ''}: {s.note}")
            for line in s.quote.splitlines():
                say(f"      | {line}")


def named(text: str) -> tuple[Profile, Profile, Line]:
    """`ENGINE[@VERSION]:MODEL` -> (its profile, the latest of its line, the line); a name that leaves the model file
    open is refused, listing the files (a trainer's profiles are model-agnostic: no MODEL needed)."""
    name = ServerName.of(text)
    lines = [ln for ln in registry.LINES if ln.engine == name.engine]
    if not name.model and lines and all(ln.models for ln in lines):
        raise UsageError(f"profile {text!r} names no model file; give {text.partition('+')[0]}:MODEL, MODEL one of "
                         f"{', '.join(ln.family for ln in lines)}")
    p = registry.lookup(text, "")
    line = next(ln for ln in registry.LINES if ln.engine == p.engine and ln.family == p.family)
    return p, line.profiles()[-1], line


def print_one(p: Profile, latest: Profile, releases: list[Classified]) -> None:
    """One profile whole: its versions and models, how it differs from the latest, every behaviour with its source
    and quote, and each release it holds for with the fingerprints' verdict."""
    say(f"{p.name}: {p.versions.text()}; models {', '.join(p.models) or 'any'}")
    diff = differences(p, latest)
    say(wrapped(f"  differs from {latest.name} (the latest): {'; '.join(diff)}" if diff else
                "  the latest profile of its line" if p.name == latest.name else f"  the same capture as {latest.name}", 4))
    print_sources([(p, latest)], {(p.engine, p.family): releases}, header=False)
    mine = [c for c in releases if c.profile.name == p.name]
    say("  releases:" if mine else "  releases: none numbered (versions are dates)")
    for c in mine:
        changed = sorted({v.key.short for v in c.verdicts if v.status in (Status.CHANGED, Status.ABSENT)})
        say(wrapped(f"    {c.release}: {c.status.value}" + (f" ({', '.join(changed)})" if changed else ""), 6))
    for n in p.notes:
        say(wrapped(f"  note: {n}", 4))


def cmd_profiles(args) -> int:
    if args.name is not None:
        p, latest, line = named(args.name)
        releases = fingerprints.classify_line(line)
        if args.json:
            emit_json(to_dict(p, latest, releases))
        else:
            print_one(p, latest, releases)
        return 0
    rows, by_line = entries(), classified()
    if args.json:
        emit_json([to_dict(p, latest, by_line[(p.engine, p.family)]) for p, latest in rows])
        return 0
    say(f"{len(rows)} profiles; --server and --train take ENGINE[@VERSION][:MODEL], e.g. "
        "sglang@0.5.12:deepseek_v2; --sources prints every behaviour with its source")
    for engine in ("sglang", "vllm"):
        say(wrapped(f"{engine}: {registry.profiled(engine)}", 2))
    table(["profile", "releases", "models", "differs from the latest", "sources"],
          [[p.name, p.versions.span(), ", ".join(p.models) or "any",
            "(latest)" if p is latest else ", ".join(d.split(":")[0] for d in differences(p, latest)),
            str(len(p.sources()))] for p, latest in rows], notes=("differs from the latest",))
    say("\n" + wrapped("source fingerprints, each release of a line against the code its profile cites (read: "
                       "the release read; same: unchanged since; changed: unread code; docs/profiles.md):", 0))
    for line in registry.LINES:
        say(wrapped(f"  {line.engine}:{line.family}: {line_summary(by_line[(line.engine, line.family)])}"))
    if args.sources:
        print_sources(rows, by_line)
    return 0
