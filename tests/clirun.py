"""`python -m tpsim` as a real process (a fork of tests/cliserver.py, which imported the CLI once),
and the bad-input contract, shared by the CLI tests."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
    pid: int = 0  # the run's process id: its session and process group too (every rank it started is in them)

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


class CliServer:
    """tests/cliserver.py, started on first use and kept for the session: every run_cli is a
    fork of it (tpsim's CLI imported once), in its own session, as `python -m tpsim` would run."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        self.dir = None

    def socket_path(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.dir = tempfile.mkdtemp(prefix="tpsim-cliserver-")
                started = threading.Event()
                # The server dies with its parent (PR_SET_PDEATHSIG), and Linux counts the parent as the
                # thread that started it: started from run_clis' worker thread, it was killed when that
                # thread ended, and the next run_cli met a dead socket. So a thread that lives as long as
                # the session starts it.
                threading.Thread(target=self._keep, args=(started,), daemon=True).start()
                started.wait()
                ready = self.proc.stdout.readline()
                assert ready == b"ready\n", f"the CLI server did not start: {ready!r}"
                atexit.register(self.stop)
            return self.socket_file()

    def _keep(self, started: threading.Event) -> None:
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cliserver.py"), self.socket_file()],
                                     cwd=ROOT, env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        started.set()
        self.proc.wait()

    def socket_file(self) -> str:
        return os.path.join(self.dir, "socket")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


SERVER = CliServer()


def run_cli(*args, cwd: Path = ROOT, timeout_s: float = RUN_TIMEOUT_S, env: dict[str, str] | None = None) -> Run:
    """`python -m tpsim ARGS` in `cwd` with `env` (default cli_env()), as a fork of the CLI server (a
    new session, killed with its children after `timeout_s`); its status and CPU time (it and the
    ranks it reaped) from wait4."""
    argv = [str(a) for a in args]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpsim-run-") as out, socket.socket(socket.AF_UNIX) as conn:
        conn.connect(SERVER.socket_path())
        paths = {"stdout": os.path.join(out, "stdout"), "stderr": os.path.join(out, "stderr")}
        conn.sendall(json.dumps({"argv": argv, "cwd": str(cwd), "env": env or cli_env(), **paths}).encode() + b"\n")
        replies = conn.makefile("rb")
        pid = json.loads(replies.readline())["pid"]
        fired = threading.Event()
        timer = threading.Timer(timeout_s, _kill_group, (pid, fired))
        timer.start()
        try:
            end = json.loads(replies.readline())
        finally:
            timer.cancel()
            replies.close()
        stdout, stderr = (Path(paths[k]).read_bytes() for k in ("stdout", "stderr"))
    return Run(argv, end["status"], stdout.decode(errors="replace"), stderr.decode(errors="replace"),
               time.monotonic() - t0, end["cpu_s"], fired.is_set(), Path(cwd), pid)


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
