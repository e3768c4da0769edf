"""`tpsim diagnose`: not implemented yet (issue 3)."""

from __future__ import annotations

from tpsim.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="(not implemented yet)")
    p.set_defaults(func=cmd_diagnose)


def cmd_diagnose(args) -> int:
    raise UsageError("tpsim diagnose is not implemented yet")
