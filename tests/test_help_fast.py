"""`tpsim --help` and `--version` answer from commands.toml without importing a command module or torch
(issue 35: --help took 3-7 s); their time is measured in benchmarks/startup.py, not asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clirun import ROOT


@pytest.mark.parametrize("argv", [["--help"], ["--version"], [], ["nosuch"]])
def test_top_level_answers_without_torch(argv):
    probe = ("import atexit, sys, runpy; atexit.register(lambda: print('TORCH' if 'torch' in sys.modules else 'NO-TORCH',"
             " 'MAIN' if 'tpsim.cli.main' in sys.modules else '', file=sys.stderr)); "
             f"sys.argv = ['tpsim', *{argv!r}]; runpy.run_module('tpsim', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stderr.strip().splitlines()[-1].strip() == "NO-TORCH", r.stderr
    assert r.returncode == (0 if argv and argv[0].startswith("--") else 2)


def test_a_command_still_loads_its_module():
    probe = ("import atexit, sys, runpy; atexit.register(lambda: print('MAIN' if 'tpsim.cli.main' in sys.modules "
             "else 'NO-MAIN', file=sys.stderr)); sys.argv = ['tpsim', 'profiles', '--help']; "
             "runpy.run_module('tpsim', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: tpsim profiles" in r.stdout and r.stderr.strip().endswith("MAIN"), r


def test_the_top_level_lists_every_command_module():
    from tpsim.cli.main import COMMANDS
    from tpsim.cli.toplevel import ORDER
    assert tuple(c.__name__.rsplit(".", 1)[1] for c in COMMANDS) == ORDER
