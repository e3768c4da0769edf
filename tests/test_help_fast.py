"""`tpsim --help`, `--version`, `tpsim COMMAND --help` and an argument argparse refuses answer without
importing torch (issue 35: --help took 3-7 s): the top level from commands.toml alone, a command's
help from tpsim.cli.arguments, whose option names are written out in tpsim.cli.choices (each copy
equal to its source). Their time is measured in benchmarks/startup.py (--only-help), not asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clirun import ROOT, cli_env

# python -c PROBE ARGS: `python -m tpsim ARGS`, saying on stderr, at the interpreter's exit, whether
# torch (or any module of it) was imported
PROBE = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: print('torch imported:', any(m == 'torch' or m.startswith('torch.')"
         " for m in sys.modules), file=sys.stderr))\n"
         "sys.argv = ['tpsim', *sys.argv[1:]]\n"
         "runpy.run_module('tpsim', run_name='__main__', alter_sys=True)\n")


def probe(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)


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


def test_the_top_level_lists_every_command_and_each_has_its_options_and_function():
    from tpsim.cli.arguments import OPTIONS
    from tpsim.cli.main import build_parser, command_function
    from tpsim.cli.toplevel import ORDER
    assert tuple(OPTIONS) == ORDER
    subs = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert tuple(subs) == ORDER
    for name in ORDER:
        assert callable(command_function(name)), name


COMMAND_LINES = {**{f"{c} --help": ([c, "--help"], 0) for c in
                    ("triage", "acceptance", "draft", "check", "capture", "export", "explain", "align", "diagnose", "scenario", "verify",
                     "resolve", "profiles")},
                 "check --tp (no value)": (["check", "--tp"], 2), "triage (no --draft-config)": (["triage"], 2),
                 "capture --bogus": (["capture", "--out", "x.safetensors", "--bogus"], 2)}


@pytest.mark.parametrize("case", list(COMMAND_LINES))
def test_a_commands_help_and_a_refused_argument_import_no_torch(case):
    argv, status = COMMAND_LINES[case]
    r = probe(argv)
    assert r.returncode == status, (r.stdout, r.stderr)
    assert r.stderr.splitlines()[-1] == "torch imported: False", r.stderr
    if status == 0:
        assert r.stdout.startswith(f"usage: tpsim {argv[0]}"), r.stdout
    else:
        assert r.stderr.startswith("tpsim: error: ") and len(r.stderr.splitlines()) == 2, r.stderr


def test_the_probe_sees_torch_when_a_command_runs():
    """The test above can fail: a command that runs imports torch, and the probe says so."""
    r = probe(["resolve", "--convention", "sglang-ids", "--num-layers", "61"])
    assert r.returncode == 0 and r.stderr.splitlines()[-1] == "torch imported: True", r.stderr


def test_the_names_the_options_list_are_their_sources():
    from tpsim.app.run_options import DEFAULT_GRAPH_TOKENS, GRAPH_IDS
    from tpsim.capture.pipeline import PP_CAPTURES
    from tpsim.cli import choices
    from tpsim.modes import DP_LOCAL_TOKENS, DP_PADDINGS, EP_OUTPUTS, MODES
    from tpsim.parallel.pipeline import SPLITS
    from tpsim.profiles.conventions import CONVENTIONS
    from tpsim.profiles.profile import Gpu
    from tpsim.weights.gguf_builtin import GGUF_TARGETS
    assert choices.MODES == MODES
    assert choices.EP_OUTPUTS == EP_OUTPUTS
    assert choices.DP_PADDINGS == DP_PADDINGS
    assert choices.DP_LOCAL_TOKENS == DP_LOCAL_TOKENS
    assert choices.CONVENTIONS == CONVENTIONS
    assert choices.GPUS == tuple(g.value for g in Gpu)
    assert choices.SPLITS == SPLITS
    assert choices.PP_CAPTURES == tuple(PP_CAPTURES)
    assert choices.GRAPH_IDS == tuple(GRAPH_IDS)
    assert choices.DEFAULT_GRAPH_TOKENS == DEFAULT_GRAPH_TOKENS
    assert choices.GGUF_TARGETS == tuple(GGUF_TARGETS)
