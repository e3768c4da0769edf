"""A process that has imported tpsim's CLI once and runs each `tpsim ARGS` of the tests as a fresh
fork of itself: the import (~2.5 s of CPU) is paid once per test session, not once per run.

    python tests/cliserver.py SOCKET

Each connection to the Unix socket SOCKET carries one run: the request (JSON: argv, cwd, env,
stdout and stderr paths) in, then two JSON lines out: {"pid": P} as soon as the run started (the
client kills process group P on its timeout), {"status": ..., "cpu_s": ...} when it ended. Per
request the server forks a runner; the runner forks the run in a new session, with the request's
environment, working directory and output files, as `python -m tpsim ARGS` would have them, and
waits for it (wait4: its exit status, and the CPU time of it and the ranks it reaped). The run
ends as the interpreter does: atexit handlers, then the exit status of `main()`.

What the fork cannot give a run is a fresh import: a test of what happens while tpsim imports
(Ctrl-C during the import, the fork server's guard) starts `python -m tpsim` itself.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import tempfile
import traceback
from pathlib import Path


def _exit_code(e: SystemExit) -> int:
    """What the interpreter exits with for SystemExit(e.code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run(request: dict) -> None:
    """In the forked child: become `python -m tpsim ARGV`, run, exit. Never returns."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR as this run has it
    fd_in = os.open(os.devnull, os.O_RDONLY)
    fd_out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
    import tpsim.__main__ as entry
    sys.argv = [entry.__file__, *request["argv"]]
    try:
        code = entry.main()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def _runner(conn: socket.socket) -> None:
    """In the forked runner: start the run, report its pid, wait for it, report how it ended."""
    with conn.makefile("rb") as f:
        request = json.loads(f.readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status, usage = os.wait4(pid, 0)
    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status),
                             "cpu_s": usage.ru_utime + usage.ru_stime}).encode() + b"\n")
    conn.close()
    os._exit(0)


def serve(path: str) -> None:
    from tpsim.parallel.deathsig import die_with_parent
    die_with_parent(os.getppid())  # the test session gone: so is the server
    import tpsim.cli  # noqa: F401  (the point: everything the CLI imports, once)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runners reap themselves
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the runner waits for its run
            try:
                _runner(conn)
            finally:
                os._exit(1)
        conn.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    serve(sys.argv[1])
