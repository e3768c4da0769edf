"""--force: the one rule for every file tpsim writes (tpsim.app.preflight.check_output checks them)."""

from __future__ import annotations

import argparse


def add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace an existing output (one rule for every file tpsim "
                                                        "writes)")
