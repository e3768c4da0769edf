"""`python -m tpsim ARGS` as a fork of this process: the same command, in its own working directory,
environment and output files, without importing torch and tpsim again (~2.5 s of CPU a run).
`tpsim scenario` runs its steps this way; so do the tests (tests/cliserver.py)."""

from __future__ import annotations

import atexit
import multiprocessing.process as mp_process
import multiprocessing.util as mp_util
import os
import runpy
import signal
import sys
import tempfile
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path

from tpsim.base import ui
from tpsim.parallel.pool import can_fork  # noqa: F401  (callers ask it before run())


@dataclass(frozen=True)
class Ended:
    status: int  # as subprocess gives it: the exit code, or -N for signal N
    cpu_s: float  # user + system of the run and the ranks it reaped


def _exit_code(e: SystemExit) -> int:
    """What the interpreter exits with for SystemExit(e.code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _forget_the_parent() -> None:
    """What the parent registered to do at its exit, and the children it started, are not this
    run's: its atexit handlers (a test session's clean-up), its temporary directories' finalizers,
    its multiprocessing children (which multiprocessing's exit handler would terminate). Reset as
    multiprocessing resets its own children (BaseProcess._bootstrap)."""
    for f in list(weakref.finalize._registry):
        f.atexit = False
    atexit._clear()
    atexit.register(weakref.finalize._exitfunc)  # this run's own finalizers still run at its exit
    mp_process._children = set()
    mp_util._finalizer_registry.clear()
    mp_util._run_after_forkers()
    atexit.register(mp_util._exit_function)


def become(argv: list[str], cwd: str | Path, env: dict[str, str], stdout: str | Path, stderr: str | Path) -> None:
    """In a freshly forked child: run `python -m tpsim ARGV` as a new interpreter would (fresh
    consoles, default signal handlers, atexit at the end), then exit with its status. Never returns."""
    code = 1
    try:
        _forget_the_parent()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # TMPDIR as this run has it
        for path, fd, flags in ((os.devnull, 0, os.O_RDONLY), (stdout, 1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (stderr, 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        # streams on those descriptors, as a new interpreter opens them (the parent's sys.stdout may be
        # anything: a pipe-safe wrapper, a test runner's capture)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it
        ui.reopen()
        sys.argv = [str(Path(__file__).resolve().parents[1] / "__main__.py"), *argv]
        try:
            runpy.run_module("tpsim", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run(argv: list[str], cwd: str | Path, env: dict[str, str], stdout: str | Path, stderr: str | Path) -> Ended:
    """Fork, `become` the command in the child, wait for it (can_fork() must hold)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        become(argv, cwd, env, stdout, stderr)
    _, status, usage = os.wait4(pid, 0)
    return Ended(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)
