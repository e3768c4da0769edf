"""The command line: `tpsim.cli.toplevel` answers `tpsim --help` and `--version` from commands.toml alone
(no command module, no torch: under a second); `tpsim.cli.main` parses and runs a command.

Exit codes: 0 every property holds; 1 a property failed; 2 bad input; 3 a rank failed or
stalled; 4 an output could not be written (the previous file, if any, is untouched).

One module per command (its arguments and its printing); what they share is in options.py.
"""
