"""Terminal output: tables (rich) and the progress line."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich import box
from rich.table import Table
from rich.text import Text

WIDTH = 100  # what a table may take (a pipe gets this width too)
BENCH_WIDTH = 200  # a benchmark's table: numbers never fold


def _consoles() -> tuple[Console, Console]:
    """(stdout, stderr) as this process's streams and environment are now (terminal, width, colour)."""
    probe = Console()
    return (Console(highlight=False, width=min(probe.width, WIDTH) if probe.is_terminal else WIDTH),
            Console(stderr=True, highlight=False))


stdout, stderr = _consoles()


def reopen() -> None:
    """Consoles for streams that changed under this process (a forked command's: tpsim.app.forked)."""
    global stdout, stderr
    stdout, stderr = _consoles()


_STEPS: list[str] = []  # what the progress lines are for, outermost first (`step`)


@contextmanager
def step(name: str):
    """Name the step the progress lines inside belong to ("replaying fix 2 of 4"): each line says it."""
    _STEPS.append(name)
    try:
        yield
    finally:
        _STEPS.pop()


class ProgressLine:
    """A live status line on a terminal; plain `tpsim: ...` lines on stderr otherwise, each naming its step."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._status = None

    def __call__(self, msg: str) -> None:
        if not self.enabled:
            return
        msg = ": ".join([*_STEPS, msg])
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


class PipeSafe:
    """stdout that a closed pipe (`tpsim ... | head`) does not break: the rest of the output is
    dropped and the command still ends with its own exit status, not a write error."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop_the_rest()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop_the_rest()

    def _drop_the_rest(self) -> None:  # the interpreter's own flush at exit must not fail either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


VERDICTS = {"PASS": "bold green", "ALIGNED": "bold green", "ok": "green", "yes": "green",
            "FAIL": "bold red", "NO": "bold red", "NOT ALIGNED": "bold red"}
_LONGEST_FIRST = sorted(VERDICTS, key=len, reverse=True)  # "NOT ALIGNED" before "NO"
NOTE_AT = 28  # a cell of a notes column longer than this becomes a numbered note under the table


def verdict(text: str) -> Text:
    """`text` with its leading verdict word coloured (rich drops colour on a pipe and under NO_COLOR)."""
    out = Text(text)
    word = next((w for w in _LONGEST_FIRST if text == w or text.startswith((w + ":", w + " "))), None)
    if word is not None:
        out.stylize(VERDICTS[word], 0, len(word))
    return out


def say(text: str = "") -> None:
    """One line of a report, however long (so it can be grepped), its verdict word coloured."""
    stdout.print(verdict(text), soft_wrap=True)


def table(columns: list[str], rows: list[list], notes: tuple[str, ...] = (), whole: tuple[str, ...] = (),
          width: int | None = None) -> None:
    """Print a table that fits WIDTH: cells of the `notes` columns longer than NOTE_AT go under it
    as numbered notes, each text once however many rows share it (a cell there may be a list of
    texts: each its own note); the first column and the `whole` ones never wrap. Cells are text,
    not markup."""
    t = Table(box=box.SIMPLE_HEAD)
    for i, c in enumerate(columns):
        t.add_column(c, overflow="fold", no_wrap=i == 0 or c in whole)
    said: dict[str, int] = {}
    for r in rows:
        cells = []
        for c, text in zip(columns, r):
            if c in notes:
                parts = text if isinstance(text, list) else [text]
                text = " ".join(f"[{said.setdefault(p, len(said) + 1)}]" if len(p) > NOTE_AT else p for p in parts)
            cells.append(verdict(text))
        t.add_row(*cells)
    stdout.print(t, width=width)
    for text, n in said.items():
        say(f"[{n}] {text}")


def titled_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A benchmark's table: its title on a line of its own, then `table`, as wide as its eleven-odd numeric
    columns need (at WIDTH a median folded mid-number, 138.1 over 5)."""
    stdout.print(title, markup=False, highlight=False)
    table(columns, rows, whole=tuple(columns[:2]), width=BENCH_WIDTH)


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
