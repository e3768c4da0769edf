"""`tpsim COMMAND ...` / `python -m tpsim COMMAND ...`: every command's parser and the error handling.

Exit codes: 0 every property holds; 1 a property failed; 2 bad input; 3 a rank failed or
stalled; 4 an output could not be written (the previous file, if any, is untouched).

One module per command (what it runs and prints), imported once the command line has been read
(command_function); every command's options are in arguments.py (their prose in commands.toml),
what they share in options.py. Reading the command line imports no torch: `tpsim COMMAND --help`
and an argument argparse refuses answer at once.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import time

from tpsim.cli.arguments import add_parser
from tpsim.cli.toplevel import ORDER, top_parser
from tpsim.cli.parser import Parser
from tpsim.base.environ import asked_start_method, check_torchrun_env, dead_local_peers, is_reporting_process, \
    under_torchrun
from tpsim.base.errors import RankError, UsageError
from tpsim.base import faults
from tpsim.base.ui import PipeSafe

REPORT_GRACE_S = 5.0


def build_parser() -> Parser:
    parser, sub = top_parser()
    for name in ORDER:
        add_parser(sub, name)
    return parser


def command_function(name: str):
    """What runs command `name`: cmd_NAME of tpsim/cli/NAME.py, imported here, once the command line
    has been read (those modules import torch: --help, and what argparse refuses, never get this far)."""
    return getattr(importlib.import_module(f"tpsim.cli.{name}"), f"cmd_{name}")


def import_commands() -> None:
    """Every command's module imported now, by a process whose forks run commands (tpsim scenario,
    tests/cliserver.py), so that no fork imports them (and torch) again."""
    for name in ORDER:
        command_function(name)


def main(argv: list[str] | None = None, imported=None) -> int:
    """`imported`: called once the command's module (torch with it) is imported, before it runs."""
    # SIGTERM unwinds like Ctrl-C, so the rank pool's cleanup runs (ranks stopped, rendezvous removed)
    signal.signal(signal.SIGTERM, on_sigterm)
    if not isinstance(sys.stdout, PipeSafe):
        sys.stdout = PipeSafe(sys.stdout)
    code = run_command(argv, imported)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the report is out
    if under_torchrun():
        from tpsim.parallel.torchrun import exit_torchrun_rank  # torch: loaded already where a rank ran a job
        exit_torchrun_rank(code)
    return code


def on_sigterm(signum, frame) -> None:
    """Unwind with exit 128 + SIGTERM. Under torchrun the agent sends SIGTERM because a local rank
    failed: when one is gone, that is the error to report, not the signal."""
    if under_torchrun() and _running_job and is_reporting_process():
        gone = dead_local_peers()
        if gone:
            raise RankError(f"rank {gone[0]} died (its process is gone); torchrun stopped the other ranks")
    sys.exit(128 + signum)


_running_job = False  # on_sigterm may name a dead peer only while the command runs, not while it reports


def run_command(argv: list[str] | None, imported=None) -> int:
    try:  # the environment first: a broken one is every process's to report (RANK may say "not rank 0")
        check_torchrun_env()
        faults.check()
        asked_start_method()  # TPSIM_RANK_START, read when a pool starts
    except UsageError as e:
        print(f"tpsim: error: {e}", file=sys.stderr)
        return 2
    global _running_job
    try:
        args = build_parser().parse_args(argv)
        run = command_function(args.command)
        if imported is not None:
            imported()
        _running_job = True
        try:
            return run(args)
        finally:
            _running_job = False
    except UsageError as e:
        if is_reporting_process():  # one line, even when a user-given name holds a line break
            one_line = "\\n".join(str(e).splitlines())
            print(f"tpsim: error: {one_line}", file=sys.stderr)
        elif under_torchrun():  # torchrun stops every rank when one exits: let rank 0 print the error first
            time.sleep(REPORT_GRACE_S)
        return 2
    except RankError as e:
        print(f"tpsim: error: {str(e).splitlines()[0]}", file=sys.stderr)
        if os.environ.get("TPSIM_DEBUG"):
            print(str(e), file=sys.stderr)
        return 3
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:  # raised by a path check, before anything is written
            print(f"tpsim: error: a path is too long ({e.strerror}): {str(e.filename)[:60]}...; use a shorter "
                  "name", file=sys.stderr)
            return 2
        # writing an output failed (disk full, I/O error): the previous file is untouched
        where = f" {e.filename}" if e.filename else ""
        print(f"tpsim: error: could not write the output{where}: {e.strerror or e}; nothing was replaced",
              file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print("tpsim: interrupted", file=sys.stderr)
        return 130
