"""The one error type users see: a one-line message that names the problem and the fix."""

from __future__ import annotations

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
