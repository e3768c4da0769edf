"""tpsim.app.forked: `python -m tpsim ARGS` as a fork of this process behaves as the new interpreter
would (`tpsim scenario` runs its steps this way, the tests' CLI server too), and leaves this
process's own state alone: its temporary directories, its exit handlers, its children."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


from clirun import cli_env
from tpsim.app import forked


def run(argv, cwd: Path, env: dict | None = None) -> tuple[forked.Ended, str, str]:
    out, err = cwd.parent / f"{cwd.name}.out", cwd.parent / f"{cwd.name}.err"
    ended = forked.run([str(a) for a in argv], cwd, env or cli_env(), out, err)
    return ended, out.read_text(), err.read_text()


def alone() -> bool:
    """can_fork(), once threads an earlier test just finished with (a cancelled Timer) have ended."""
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return forked.can_fork()


def forking(test):
    """Run `test(cwd)` in this process when it may fork; in a fresh interpreter when an earlier test of
    this worker left a thread running (transformers' loaders leave a thread pool and tqdm's monitor)."""
    def run(tmp_path):
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        if alone():
            return test(cwd)
        code = (f"import sys, pathlib; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_forked; "
                f"test_forked.{test.__name__}.body(pathlib.Path({str(cwd)!r}))")
        r = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    run.__name__, run.__doc__, run.body = test.__name__, test.__doc__, test
    return run


@forking
def test_a_forked_command_prints_exits_and_writes_as_the_command_does(cwd):
    assert alone(), threading.enumerate()
    ended, out, err = run(["resolve", "--convention", "specforge-ids", "--layers", "1,29,57", "--num-layers", "61"], cwd)
    assert ended.status == 0 and "specforge-ids 1,29,57 on 61 layers -> out(1), out(29), out(57)" in out, (out, err)
    ended, out, err = run(["export", "--out", "ck"], cwd)  # a relative path: the run's working directory
    assert ended.status == 0, err
    assert json.loads((cwd / "ck" / "config.json").read_text())["num_hidden_layers"] == 8
    ended, out, err = run(["check", "--tp", "1,2", "--seq-len", "4"], cwd)  # ranks forked from the fork
    assert ended.status == 0 and out.splitlines()[-1].startswith("PASS: "), (out, err)


@forking
def test_bad_input_and_the_environment_reach_the_run(cwd):
    assert alone(), threading.enumerate()
    ended, out, err = run(["check", "--tp", "0"], cwd)
    assert ended.status == 2 and out == "" and err.count("\n") == 1 and err.startswith("tpsim: error: "), err
    ended, out, err = run(["check", "--tp", "1"], cwd, {**cli_env(), "TPSIM_FAULT": "garbage"})
    assert ended.status == 2 and "TPSIM_FAULT='garbage' is not RANK:WHERE:HOW" in err, err
    assert not any(cwd.iterdir())


@forking
def test_the_parents_exit_handlers_and_temporary_directories_stay_the_parents(cwd):
    """A fork inherits the parent's atexit handlers and the finalizers of its TemporaryDirectory
    objects: run at the fork's exit they removed the parent's directories (the scenario runner's
    own, in the first version) and stopped the test session's CLI server."""
    assert alone(), threading.enumerate()
    mark = cwd.parent / "handler-ran"
    handler = lambda: mark.write_text(str(os.getpid()))  # noqa: E731
    atexit.register(handler)
    try:
        with tempfile.TemporaryDirectory(dir=cwd.parent) as mine:
            ended, out, err = run(["profiles"], cwd)
            assert ended.status == 0, err
            assert Path(mine).is_dir()
        assert not mark.exists()
    finally:
        atexit.unregister(handler)


def test_a_fork_is_refused_beside_another_thread():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not forked.can_fork()
    finally:
        stop.set()
        other.join()


def test_the_cli_server_outlives_the_thread_that_first_asked_for_it():
    """run_clis' worker thread started the session's CLI server, which dies with its parent thread
    (PR_SET_PDEATHSIG): when the thread ended the server was killed and the next run met a reset
    socket (test_pp failed after a run_clis whenever that call started the server)."""
    from clirun import CliServer
    server = CliServer()
    try:
        t = threading.Thread(target=server.socket_path)
        t.start()
        t.join()
        time.sleep(0.5)  # a SIGKILL on the thread's exit lands within this
        assert server.proc.poll() is None, "the CLI server died with the thread that started it"
    finally:
        server.stop()
