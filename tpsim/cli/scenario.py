"""`tpsim scenario NAME`: run one of the ready-made cases in `configs/scenarios/` and show
the failure it is about being caught.

A scenario is a YAML file: `description` (the real bug, with its source), `argv` (one tpsim
command) or `steps` (several), and what the last command must do: `expect_exit` and `expect`
(substrings of its output). In commands and expectations `{tmp}` is a fresh temporary directory
and `{configs}` the built-in configs' directory, so each command printed runs from anywhere.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass

import yaml

from tpsim.config import BUILTIN_CONFIGS
from tpsim.errors import UsageError

SCENARIOS = BUILTIN_CONFIGS / "scenarios"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    steps: tuple[tuple[str, ...], ...]
    expect_exit: int
    expect: tuple[str, ...]

    def commands(self, tmp: str) -> list[list[str]]:
        return [[fill(a, tmp) for a in step] for step in self.steps]

    def expected(self, tmp: str = "") -> list[str]:
        return [fill(e, tmp) for e in self.expect]

    @property
    def summary(self) -> str:
        return " ".join(self.description.split())


def fill(text, tmp: str) -> str:
    return str(text).replace("{configs}", str(BUILTIN_CONFIGS)).replace("{tmp}", tmp)


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load(name: str) -> Scenario:
    if name not in available():  # not a path: ../tiny would name configs/tiny.yaml
        raise UsageError(f"unknown scenario {name!r}; tpsim scenario --list shows {', '.join(available())}")
    raw = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    steps = raw.get("steps") or [raw["argv"]]
    return Scenario(name, str(raw["description"]), tuple(tuple(str(a) for a in st) for st in steps),
                    int(raw["expect_exit"]), tuple(str(e) for e in raw.get("expect", [])))


def run(name: str, echo: bool = True) -> tuple[bool, str]:
    """Run scenario `name`; (expectation met, last command's output)."""
    spec = load(name)
    with tempfile.TemporaryDirectory(prefix="tpsim-scenario-") as tmp:
        for i, argv in enumerate(spec.commands(tmp)):
            if echo:
                print(f"$ tpsim {shlex.join(argv)}", flush=True)
            p = subprocess.run([sys.executable, "-m", "tpsim", *argv], cwd=tmp, capture_output=True, text=True)
            text = p.stdout + p.stderr
            if echo:
                print(text, end="" if text.endswith("\n") else "\n", flush=True)
            last = i == len(spec.steps) - 1
            if not last and p.returncode != 0:
                return False, text
        ok = p.returncode == spec.expect_exit and all(e in text for e in spec.expected(tmp))
        return ok, text


def add_parser(sub) -> None:
    p = sub.add_parser("scenario", help="run a ready-made case that shows a known capture bug being caught",
                       description="Run a ready-made case: a real capture bug (its source in the description), "
                                   "the tpsim commands that show it, and whether tpsim catches it as expected.",
                       epilog="examples:\n  tpsim scenario --list\n  tpsim scenario align-vllm-top-level-copy")
    p.add_argument("name", nargs="?", help="scenario name (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.set_defaults(func=cmd_scenario)


def cmd_scenario(args) -> int:
    if args.list and args.name is not None:
        raise UsageError(f"--list and a scenario name ({args.name!r}) both given; pass --list, or the name to run it")
    if args.list or args.name is None:
        width = max(map(len, available()))
        for name in available():
            print(f"{name:{width}}  {textwrap.shorten(load(name).summary, 98 - width, placeholder=' ...')}")
        return 0
    spec = load(args.name)
    print(spec.summary, end="\n\n")
    ok, _ = run(args.name)
    print(f"scenario {args.name}: {'caught as expected' if ok else 'NOT as expected'} "
          f"(expected exit {spec.expect_exit} and {spec.expected()})")
    return 0 if ok else 1
