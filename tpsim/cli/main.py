"""`tpsim COMMAND ...` / `python -m tpsim COMMAND ...`: every command's parser and the error handling.

Exit codes: 0 every property holds; 1 a property failed; 2 bad input; 3 a rank failed or
stalled; 4 an output could not be written (the previous file, if any, is untouched).

One module per command (its arguments and its printing); what they share is in options.py.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

from tpsim.cli.toplevel import ORDER, top_parser
from tpsim.cli import align, capture, check, diagnose, explain, export, profiles, resolve, scenario, triage, verify
from tpsim.cli.parser import Parser
from tpsim.base.errors import RankError, UsageError
from tpsim.base import faults
from tpsim.parallel.pool import start_method
from tpsim.parallel.torchrun import check_torchrun_env, exit_torchrun_rank, under_torchrun
from tpsim.app.ranks import dead_local_peers, is_reporting_process
from tpsim.base.ui import PipeSafe

REPORT_GRACE_S = 5.0
COMMANDS = (triage, check, capture, export, explain, align, diagnose, scenario, verify, resolve, profiles)


def build_parser() -> Parser:
    parser, sub = top_parser()
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C, so the rank pool's cleanup runs (ranks stopped, rendezvous removed)
    signal.signal(signal.SIGTERM, on_sigterm)
    if not isinstance(sys.stdout, PipeSafe):
        sys.stdout = PipeSafe(sys.stdout)
    code = run_command(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # the report is out
    if under_torchrun():
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


def run_command(argv: list[str] | None) -> int:
    try:  # the environment first: a broken one is every process's to report (RANK may say "not rank 0")
        check_torchrun_env()
        faults.check()
        start_method("cpu")  # TPSIM_RANK_START, read when a pool starts
    except UsageError as e:
        print(f"tpsim: error: {e}", file=sys.stderr)
        return 2
    global _running_job
    try:
        args = build_parser().parse_args(argv)
        _running_job = True
        try:
            return args.func(args)
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
