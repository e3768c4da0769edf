"""`tpsim draft NAME --copy DIR`: a draft (a built-in by name, a directory or a config file) copied out to a new
directory, so the examples that edit one run from a pip install as from a checkout."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tpsim.base.atomic import umask
from tpsim.base.errors import UsageError

DRAFT_FILES = ("config.json", "*.safetensors", "pytorch_model.bin")


def copy_draft(source: Path, dest: Path, force: bool = False) -> list[str]:
    """Copies the draft's files into `dest`, a directory that must not exist yet (`force`: or a draft directory, of
    config.json and weights only, which is replaced; a config file under another name becomes `dest/config.json`);
    nothing changes at `dest` if a copy fails. Returns the names written."""
    if dest.is_symlink() or dest.exists() and not (force and _a_draft(dest)):
        raise UsageError(f"--copy {dest}: it exists; give a new directory" +
                         (" (--force replaces only a directory of a draft's files)" if force else
                          ", or --force to replace a draft copied there before"))
    if dest.resolve() == source.resolve() or dest.resolve() in source.resolve().parents:
        raise UsageError(f"--copy {dest}: that is the draft itself; give a new directory")
    if not dest.parent.is_dir():
        raise UsageError(f"--copy {dest}: {dest.parent} is not a directory; create it first")
    files = [(source, "config.json")] if source.is_file() else \
        [(f, f.name) for pattern in DRAFT_FILES for f in sorted(source.glob(pattern))]
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for f, name in files:
            shutil.copyfile(f, staging / name)
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp's own mode is 0700
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [name for _, name in files]


def _a_draft(folder: Path) -> bool:
    """A directory holding a draft's files and nothing else (what --force may replace)."""
    names = {f.name for f in folder.iterdir()} if folder.is_dir() else None
    return bool(names) and "config.json" in names and \
        all(any(Path(n).match(p) for p in DRAFT_FILES) for n in names)
