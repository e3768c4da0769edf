"""The one error type users see: a one-line message that names the problem and the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UsageError(Exception):
    """Bad input. The CLI prints `tpsim: error: <message>` and exits 2, without a traceback."""


class RankError(Exception):
    """A rank failed or stalled; the message names the rank and what it was doing."""


def quoted(value) -> str:
    """`value` as an error quotes it, cut to 80 characters (a million-entry list stays one short line)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:76] + " ..."


def read_text(path: Path, name: str, kind: str, fix: str) -> str:
    """The text of `path`, or one line naming the file (`name`, e.g. "config"), what it should
    hold (`kind`, e.g. "YAML/JSON") and the `fix`."""
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{name} {path} is not a text file (binary data, not {kind}); {fix}") from None
    except OSError as e:
        raise UsageError(f"cannot read {name} {path}: {e.strerror or e.__class__.__name__}; check the path and "
                         "permissions") from None


def read_regular_text(path: Path, option: str, fix: str, limit: int) -> str:
    """The UTF-8 text of `path`, given as `option`: opened without blocking (a FIFO would wait for a writer
    forever), refused unless a regular file, read up to `limit` bytes; each refusal one line ending in `fix`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot read it ({e.strerror or e}); {fix}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{option} {path} is not a regular file (a directory, FIFO, device or socket); {fix}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UsageError(f"{option} {path} is over {limit >> 20} MiB, more than tpsim reads; split it into smaller "
                         "files")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path} is not UTF-8 text (binary data); {fix}") from None
