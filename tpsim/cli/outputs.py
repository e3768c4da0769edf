"""The files a command writes: one rule for all of them (checked before anything runs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tpsim.base.errors import UsageError
from tpsim.base.atomic import temporary_name


def add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace an existing output (one rule for every file tpsim "
                                                        "writes)")


def check_output(out: Path, option: str, example: str, force: bool) -> None:
    """An output tpsim may write: a regular file or a new name in a writable directory, with the
    suffix of its format (that of `example`), replaced only with --force."""
    suffix = Path(example).suffix
    if not out.parent.is_dir():
        raise UsageError(f"{option} {out}: directory {out.parent} does not exist; create it first")
    if out.is_symlink():  # replacing it would replace the link, not what it points to: say which is meant
        raise UsageError(f"{option} {out} is a symbolic link; give the path it points to ({out.resolve()}) or a new name")
    if out.is_dir():
        raise UsageError(f"{option} {out} is a directory; give a file name like {out / example}")
    if out.exists() and not out.is_file():
        raise UsageError(f"{option} {out} is not a regular file (a FIFO, a device or a socket); give a file name")
    if out.suffix != suffix:  # safetensors under a .pt name fails torch.load
        raise UsageError(f"{option} {out}: tpsim writes {suffix[1:]} here; name it {out.with_suffix(suffix).name}")
    if out.exists() and not force:
        raise UsageError(f"{option} {out} exists; pass --force to replace it, or give a new name")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"{option} {out}: directory {out.parent} is not writable")
    need, limit = len(temporary_name(out).encode()), os.pathconf(out.parent, "PC_NAME_MAX")
    if need > limit:
        raise UsageError(f"{option} {out.name[:40]}...: the name is too long for the temporary file written beside "
                         f"it ({need} of {limit} bytes); use a name of at most "
                         f"{limit - (need - len(out.name.encode()))} bytes")
