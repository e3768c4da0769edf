"""Terminal output: tables (rich) and the progress line."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich import box
from rich.table import Table

_probe = Console()
# Not a terminal (a pipe, CI): wide enough that the check table never wraps.
stdout = Console(highlight=False, width=None if _probe.is_terminal else 200)
stderr = Console(stderr=True, highlight=False)


class ProgressLine:
    """A live status line on a terminal; plain `tpsim: ...` lines on stderr otherwise."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._status = None

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        if stderr.is_terminal:
            if self._status is None:
                self._status = stderr.status(msg)
                self._status.start()
            else:
                self._status.update(msg)
        else:
            print(f"tpsim: {msg}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    t = Table(title=title or None, title_justify="left", box=box.SIMPLE_HEAD)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


@contextmanager
def progress_bar(what: str, total: int):
    """A rich progress bar on a terminal (nothing otherwise); yields `advance()`."""
    if not stderr.is_terminal:
        yield lambda: None
        return
    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=stderr, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)


def human_bytes(n: float, binary: bool = False) -> str:
    """`1.23 GB` (powers of 1000, 3 significant digits: memory and disk needs), or with `binary`
    `2.0 KiB` (powers of 1024, one decimal: per-rank tensor sizes)."""
    step, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    for unit in units[:-1]:
        if n < step:
            if binary:
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            return f"{n:.3g} {unit}"
        n /= step
    return f"{n:.1f} {units[-1]}" if binary else f"{n:.3g} {units[-1]}"
