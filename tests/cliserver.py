"""A process that has imported tpsim's commands once and runs each `tpsim ARGS` of the tests as a fresh
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

import json
import os
import signal
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpsim.base.deathsig import die_with_parent  # noqa: E402  (standard library only)


def _runner(conn: socket.socket) -> None:
    """In the forked runner: start the run, report its pid, wait for it, report how it ended."""
    with conn.makefile("rb") as f:
        request = json.loads(f.readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setsid()  # a process group of its own, which the client kills on its timeout
        from tpsim.app.forked import become  # imported by serve() with the CLI: no cost here
        become(request["argv"], request["cwd"], request["env"], request["stdout"], request["stderr"])
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status, usage = os.wait4(pid, 0)
    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status),
                             "cpu_s": usage.ru_utime + usage.ru_stime}).encode() + b"\n")
    conn.close()
    os._exit(0)


def serve(path: str) -> None:
    die_with_parent(os.getppid())  # the test session gone: so is the server (before torch's import)
    from tpsim.cli.main import import_commands
    import_commands()  # the point: everything the commands import (torch too), once
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
    serve(sys.argv[1])
