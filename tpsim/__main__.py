"""`python -m tpsim` and the `tpsim` script. Ctrl-C while torch is still importing (seconds: the
command's module imports it once the command line has been read) ends as Ctrl-C does later, with one
line and exit 130, not a traceback from inside an import."""

import os
import signal
import sys

from tpsim.cli.toplevel import answer, names_a_command


def _interrupted_while_starting(signum, frame) -> None:
    print("tpsim: interrupted", file=sys.stderr)
    os._exit(130)


def main() -> int:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
    if not names_a_command(sys.argv[1:]):  # --help, --version: answered without a command module (or torch)
        return answer(sys.argv[1:])
    from tpsim.cli.main import main as run_cli

    # once the command's module is imported, the command unwinds on Ctrl-C (ranks stopped)
    return run_cli(imported=lambda: signal.signal(signal.SIGINT, signal.default_int_handler))


if __name__ == "__main__":
    raise SystemExit(main())
