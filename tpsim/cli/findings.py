"""A finding as `tpsim triage` and `tpsim draft` print it (the engine's findings and a draft checkpoint's alike)."""

from __future__ import annotations

from tpsim.base.ui import say


def say_finding(number: int, title: str, cause: str, sources: list[str], fix: str) -> None:
    """A blank line, then the finding's title, its cause, each source, the fix."""
    say()
    say(f"FINDING {number}: {title}")
    say(f"  cause: {cause}")
    for src in sources:
        say(f"  source: {src}")
    say(f"  fix: {fix}")
