"""What a benchmark records of where it ran: the commit measured (and whether the tree had uncommitted changes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "") \
            if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
