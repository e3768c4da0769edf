"""`tpsim align`: not implemented yet (issue 3)."""

from __future__ import annotations

from tpsim.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("align", help="(not implemented yet)")
    p.set_defaults(func=cmd_align)


def cmd_align(args) -> int:
    raise UsageError("tpsim align is not implemented yet")
