"""`tpsim profiles`: every engine profile, the versions it holds for, how it differs from that
engine's latest profile for the same model file, and its sources."""

from __future__ import annotations


from tpsim.cli.options import add_json, emit_json
from tpsim.profiles.profile import Behaviour, Profile, describe, differences
from tpsim.profiles.registry import LINES
from tpsim.base.ui import say, table
from tpsim.cli.parser import add_command


def add_parser(sub) -> None:
    p = add_command(sub, "profiles")
    p.add_argument("--sources", action="store_true", help="print every behaviour with its source")
    add_json(p, cmd_profiles)


def entries() -> list[tuple[Profile, Profile]]:
    """(profile, the latest profile of its line) for every profile, oldest first per line."""
    out = []
    for line in LINES:
        ps = line.profiles()
        out += [(p, ps[-1]) for p in ps]
    return out


def to_dict(p: Profile, latest: Profile) -> dict:
    v = p.versions
    return {"name": p.name, "engine": p.engine, "family": p.family, "models": list(p.models) or ["any"],
            "versions": {"text": v.text(), "since": v.since and _edge(v.since), "until": v.until and _edge(v.until)},
            "behaviour": {f: {"value": describe(c), "source": str(c.source), "note": c.source.note}
                          for f in Behaviour.FIELDS if (c := getattr(p.behaviour, f)) is not None},
            "differs_from_latest": differences(p, latest), "latest": p is latest,
            "sources": [str(s) for s in p.sources()], "notes": list(p.notes)}


def _edge(c) -> dict:
    return {"prs": list(c.prs), "title": c.title, "merged": c.merged and c.merged.isoformat(), "release": c.release}


def cmd_profiles(args) -> int:
    rows = entries()
    if args.json:
        emit_json([to_dict(p, latest) for p, latest in rows])
        return 0
    say(f"{len(rows)} profiles; --server and --train take ENGINE[@VERSION][:MODEL], e.g. "
        "sglang@0.5.12:deepseek_v2; --sources prints every behaviour with its source")
    table(["profile", "releases", "models", "differs from the latest", "sources"],
          [[p.name, p.versions.span(), ", ".join(p.models) or "any",
            "(latest)" if p is latest else ", ".join(d.split(":")[0] for d in differences(p, latest)),
            str(len(p.sources()))] for p, latest in rows], notes=("differs from the latest",))
    if args.sources:
        for p, _ in rows:
            say(f"\n{p.name}")
            for f in Behaviour.FIELDS:
                c = getattr(p.behaviour, f)
                if c is not None:
                    say(f"  {f}: {describe(c)}\n    {c.source}: {c.source.note}")
    return 0
