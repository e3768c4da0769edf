"""`tpsim` with no command, `tpsim --help`, `tpsim --version`: the top-level parser, its commands listed
from commands.toml (help texts as data), so these answer without importing a command or torch."""

from __future__ import annotations

import sys

from tpsim import __version__
from tpsim.base.errors import UsageError
from tpsim.cli.parser import Parser, add_command

DESCRIPTION = """\
tpsim: which tensor a tensor-parallel engine captures for an EAGLE-3 draft model. It runs a TP
reimplementation of the target over real collectives (gloo on CPU, NCCL on GPUs), replays each
engine's capture (named versions: tpsim profiles) and checks it holds what the draft trained on."""
EPILOG = """\
start here:
  tpsim triage --draft-config DRAFT/config.json --server sglang@0.5.12 --tp 8 --train specforge-ids:1,29,57
  tpsim check                      the built-in tiny model at TP 1,2,4,8
  tpsim COMMAND --help             each command's options and examples

exit codes: 0 every property holds; 1 a property failed; 2 bad input; 3 a rank failed or stalled;
4 an output could not be written (the previous file, if any, is untouched); 130 interrupted"""
ORDER = ("triage", "acceptance", "observe", "draft", "check", "capture", "export", "explain", "align", "diagnose", "scenario", "verify", "resolve",
         "profiles")  # the order of --help


def top_parser() -> tuple[Parser, object]:
    """The top-level parser and its subparsers action (no command added yet)."""
    parser = Parser(prog="tpsim", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"tpsim {__version__}")
    return parser, parser.add_subparsers(dest="command", required=True, parser_class=Parser)


def names_a_command(argv: list[str]) -> bool:
    """Whether argv names a command (else the top-level parser alone answers it)."""
    return next((a for a in argv if not a.startswith("-")), None) in ORDER


def answer(argv: list[str]) -> int:
    """Parse argv that names no command: --help and --version exit 0 (SystemExit), the rest is one line, exit 2."""
    parser, sub = top_parser()
    for name in ORDER:
        add_command(sub, name)
    try:
        parser.parse_args(argv)
    except UsageError as e:
        print(f"tpsim: error: {e}", file=sys.stderr)
    return 2
