"""`tpsim scenario NAME`: run one of the ready-made cases in `configs/scenarios/` and show
the failure it is about being caught.

A scenario is a YAML file: `description` (the real bug, with its source), `argv` (one tpsim
command) or `steps` (several; `{tmp}` is replaced by a fresh temporary directory), and what
the last command must do: `expect_exit` and `expect` (substrings of its output).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile

import yaml

from tpsim.errors import UsageError
from tpsim.run.spec import BUILTIN_CONFIGS

SCENARIOS = BUILTIN_CONFIGS / "scenarios"


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load(name: str) -> dict:
    path = SCENARIOS / f"{name}.yaml"
    if name not in available():  # not a path: ../tiny would name configs/tiny.yaml
        raise UsageError(f"unknown scenario {name!r}; tpsim scenario --list shows {', '.join(available())}")
    spec = yaml.safe_load(path.read_text())
    spec.setdefault("steps", [spec.get("argv")])
    return spec


def run(name: str, echo: bool = True) -> tuple[bool, str]:
    """Run scenario `name` from the repository root; (expectation met, last command's output)."""
    spec = load(name)
    with tempfile.TemporaryDirectory(prefix="tpsim-scenario-") as tmp:
        for i, argv in enumerate(spec["steps"]):
            argv = [str(a).replace("{tmp}", tmp) for a in argv]
            if echo:
                print(f"$ tpsim {shlex.join(argv)}", flush=True)
            p = subprocess.run([sys.executable, "-m", "tpsim", *argv], cwd=SCENARIOS.parent.parent,
                               capture_output=True, text=True)
            text = p.stdout + p.stderr
            if echo:
                print(text, end="" if text.endswith("\n") else "\n", flush=True)
            last = i == len(spec["steps"]) - 1
            if not last and p.returncode != 0:
                return False, text
        ok = p.returncode == spec["expect_exit"] and all(e in text for e in spec.get("expect", []))
        return ok, text


def add_parser(sub) -> None:
    p = sub.add_parser("scenario", help="run a ready-made case that shows a known capture bug being caught")
    p.add_argument("name", nargs="?", help="scenario name (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.set_defaults(func=cmd_scenario)


def cmd_scenario(args) -> int:
    if args.list and args.name is not None:
        raise UsageError(f"--list and a scenario name ({args.name!r}) both given; pass --list, or the name to run it")
    if args.list or args.name is None:
        for name in available():
            first = " ".join(str(load(name)["description"]).split())[:110]
            print(f"{name:40} {first}")
        return 0
    spec = load(args.name)
    print(" ".join(str(spec["description"]).split()), end="\n\n")
    ok, _ = run(args.name)
    print(f"scenario {args.name}: {'caught as expected' if ok else 'NOT as expected'} "
          f"(expected exit {spec['expect_exit']} and {spec.get('expect', [])})")
    return 0 if ok else 1
