"""The one way tpsim writes a file: a temporary name in the same directory, fsync, rename.

A killed run leaves the previous file untouched (at worst a hidden `.NAME.*.tmp` beside it),
never a partial one. `faults.at("write")` sits between the fsync and the rename, so the fault
drills (TPSIM_FAULT=RANK:write:HOW) hit a write at its most delicate point.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from tpsim.parallel import faults


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path` with the mode
    a new file gets under the umask (mkstemp's own is 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        faults.at("write")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def write_json(path: Path, data) -> None:
    """`data` as indented JSON (anything else by str()), creating the parent directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")
