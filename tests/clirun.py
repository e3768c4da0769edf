"""`python -m tpsim` as a real subprocess, and the bad-input contract, shared by the CLI tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600  # hard limit per subprocess (its whole process group), so a wedged rank cannot hang the suite
# Variables that would make tpsim think it runs under torchrun, inject faults, or print more.
SCRUB = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT", "TPSIM_DEBUG", "TPSIM_FAULT")


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass(frozen=True)
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # wall
    cpu_s: float  # user + system of the CLI process and the ranks it reaped
    timed_out: bool = False
    cwd: Path = ROOT

    def __str__(self) -> str:  # what a failing assert shows
        return (f"tpsim {' '.join(self.argv)} -> exit {self.returncode} in {self.seconds:.1f} s "
                f"({self.cpu_s:.1f} s CPU){' TIMED OUT' if self.timed_out else ''}\n"
                f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}")


def _kill_group(pgid: int, fired: threading.Event) -> None:
    fired.set()
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cli(*args, cwd: Path = ROOT, timeout_s: float = RUN_TIMEOUT_S) -> Run:
    """`python -m tpsim ARGS` in `cwd`, in its own session (killed with its children after
    `timeout_s`); waited for with wait4 to get its CPU time."""
    argv = [str(a) for a in args]
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "tpsim", *argv], cwd=cwd, env=cli_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    fired = threading.Event()
    timer = threading.Timer(timeout_s, _kill_group, (p.pid, fired))
    timer.start()
    try:
        with ThreadPoolExecutor(max_workers=2) as readers:
            out, err = readers.submit(p.stdout.read), readers.submit(p.stderr.read)
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            stdout, stderr = out.result(), err.result()
    finally:
        timer.cancel()
        p.stdout.close()
        p.stderr.close()
    return Run(argv, p.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"),
               time.monotonic() - t0, usage.ru_utime + usage.ru_stime, fired.is_set(), Path(cwd))


def run_clis(argvs: dict, workers: int = 2) -> dict:
    """`run_cli(*argv)` for each key -> argv of `argvs`, `workers` at a time; key -> Run."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {k: pool.submit(run_cli, *argv) for k, argv in argvs.items()}
        return {k: f.result() for k, f in futures.items()}


def assert_one_line_error(r: Run, expect) -> str:
    """Bad input: exit 2, no traceback, nothing on stdout, one stderr line `tpsim: error: ...`
    (so no "tpsim: starting N ranks" either) holding every string of `expect`. Returns the line."""
    assert not r.timed_out, r
    assert r.returncode == 2, r
    assert "Traceback" not in r.stdout + r.stderr, r
    assert r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpsim: error: "), r
    for s in expect:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"
    return lines[0]
