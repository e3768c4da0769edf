"""The command line's parser: argparse with tpsim's habits, and the refusal of options a
command would otherwise ignore (it knows which options were given, not only their values)."""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import sys
import textwrap
import tomllib
from importlib import resources

from tpsim.base.errors import UsageError

NEGATIVE_VALUE = re.compile(r"-\d")


class Parser(argparse.ArgumentParser):
    """argparse with tpsim's habits: no abbreviations (`--layer` is not `--layers`), a value may
    start with a minus (`--layers -1,2,30`), every error one line, and the options given on the
    command line recorded (`given`), so a command can refuse one it would otherwise ignore."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # the epilog's examples as written
        if kwargs.get("description"):  # raw, so wrapped here, paragraph by paragraph
            kwargs["description"] = "\n\n".join(textwrap.fill(" ".join(par.split()), 96)
                                                for par in kwargs["description"].split("\n\n"))
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, exit 2, no usage dump
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            close = difflib.get_close_matches(unknown.group(1).split("=")[0], self._option_string_actions, n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        args = self._join_negative_values(list(sys.argv[1:] if args is None else args))
        ns, rest = super().parse_known_args(args, namespace)
        if rest:  # here, not in the top-level parser: this parser's prog and options name the fix
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        ns.given = getattr(ns, "given", frozenset()) | self._given(args)
        return ns, rest

    def _takes_value(self, token: str) -> bool:
        action = self._option_string_actions.get(token)
        return action is not None and action.nargs in (None, "?")

    def _join_negative_values(self, args: list[str]) -> list[str]:
        """`--layers -1,2,30` as `--layers=-1,2,30`: argparse takes `-1,2,30` for an option."""
        out: list[str] = []
        for a in args:
            if a == "--":
                return out + args[len(out):]
            if out and NEGATIVE_VALUE.match(a) and self._takes_value(out[-1]):
                out[-1] = f"{out[-1]}={a}"
            else:
                out.append(a)
        return out

    def _given(self, args: list[str]) -> frozenset[str]:
        head = args[:args.index("--")] if "--" in args else args
        names = (a.split("=", 1)[0] for a in head)
        return frozenset(self._option_string_actions[n].dest for n in names if n in self._option_string_actions)

    def _get_values(self, action, arg_strings):
        # `--opt=--`: argparse (CPython < 3.12) drops the "--" and hands the option an empty list
        if arg_strings == ["--"] and action.option_strings and action.nargs in (None, "?"):
            raise UsageError(f"{'/'.join(action.option_strings)} needs a value, not '--'")
        return super()._get_values(action, arg_strings)


def refuse_without(args, needed: str, present: bool, options: dict[str, str]) -> None:
    """Refuse options (dest -> option) given on the command line that only apply with `needed`."""
    if present:
        return
    used = [opt for dest, opt in options.items() if dest in getattr(args, "given", ())]
    if used:
        raise UsageError(f"{used[0]} applies only with {needed}; add {needed}, or leave {used[0]} out")


@functools.cache
def _texts() -> dict:
    return tomllib.loads(resources.files("tpsim.cli").joinpath("commands.toml").read_text(encoding="utf-8"))


def add_command(sub, name: str) -> argparse.ArgumentParser:
    """The subcommand `name`, its help, description and examples read from commands.toml."""
    text = _texts()[name]
    examples = text["examples"]
    epilog = ("example:" if len(examples) == 1 else "examples:") + "".join(f"\n  {e}" for e in examples)
    return sub.add_parser(name, help=text["help"], description=text["description"], epilog=epilog)
