"""The one way tpsim writes a file: a temporary name in the same directory, fsync, rename.

A killed run leaves the previous file untouched (at worst a hidden `.NAME.*.tmp` beside it),
never a partial one. `faults.at("write")` sits between the fsync and the rename, so the fault
drills (TPSIM_FAULT=RANK:write:HOW) hit a write at its most delicate point.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tpsim.base import faults


TMP_SUFFIX = ".tmp"


def temporary_name(path: Path) -> str:
    """The longest name of the temporary file written beside `path` (mkstemp adds 8 characters)."""
    return f".{path.name}.{'x' * 8}{TMP_SUFFIX}"


@contextmanager
def write_errors_as_os_errors(path: Path) -> Iterator[None]:
    """A library's own error for a failed write (safetensors raises SafetensorError, not OSError,
    on a full disk) raised as the OSError the CLI reports as "could not write the output" (exit 4)."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        raise OSError(errno.EIO, f"{type(e).__name__}: {str(e).strip()}", str(path)) from e


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path` with the mode
    a new file gets under the umask (mkstemp's own is 0600)."""
    atomic_write_all([(Path(path), write)])


def atomic_write_all(files: list[tuple[Path, Callable[[str], None]]]) -> None:
    """As atomic_write for a set of files (a run's rank dumps): every one is written and synced
    before any is renamed into place, so a failed write leaves the previous set whole."""
    tmps: list[str] = []
    try:
        for path, write in files:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
            os.close(fd)
            tmps.append(tmp)
            with write_errors_as_os_errors(path):
                write(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        faults.at("write")
        for tmp, (path, _) in zip(tmps, files):
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, path)
    except BaseException:
        for tmp in tmps:
            Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def write_json(path: Path, data) -> None:
    """`data` as indented JSON (anything else by str()), creating the parent directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")
