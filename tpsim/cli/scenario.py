"""`tpsim scenario`: run the ready-made cases in `configs/scenarios/` (tpsim.app.scenarios) and
show each bug being caught: one by name, or `--all` with a table (or `--json`) of every case."""

from __future__ import annotations

import textwrap

from tpsim.cli.options import emit_json
from tpsim.base.errors import UsageError
from tpsim.app.scenarios import BUG_CLASSES, available, load, run
from tpsim.base.ui import ProgressLine, say, table
from tpsim.cli.main import import_commands


def cmd_scenario(args) -> int:
    given = [f for f, on in (("--list", args.list), ("--all", args.all), (repr(args.name), args.name is not None))
             if on]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both given; pass one of --list, --all or a scenario name")
    if args.json and not args.all:
        raise UsageError("--json reports a run of every scenario; pass --all with it")
    if args.all:
        return run_all(args.json)
    if args.list or args.name is None:
        width = max(map(len, available()))
        for name in available():
            print(f"{name:{width}}  {textwrap.shorten(load(name).summary, 98 - width, placeholder=' ...')}")
        return 0
    spec = load(args.name)
    print(f"[{spec.bug_class}] {spec.summary}", end="\n\n")
    print("sources: " + "; ".join(spec.sources), end="\n\n")
    import_commands()  # the steps run as forks of this process: what they import, imported once
    out = run(spec, echo=lambda text: print(text, flush=True))
    print(f"scenario {args.name}: {'caught as expected' if out.caught else 'NOT as expected'} "
          f"(expected exit {spec.expect_exit} and {spec.expected()})")
    return 0 if out.caught else 1


def run_all(as_json: bool) -> int:
    specs = [load(n) for n in available()]
    import_commands()  # the steps run as forks of this process: what they import, imported once
    progress = ProgressLine()
    outcomes = []
    try:
        for i, spec in enumerate(specs):
            progress(f"scenario {i + 1}/{len(specs)}: {spec.name}")
            outcomes.append(run(spec))
    finally:
        progress.stop()
    caught = sum(o.caught for o in outcomes)
    if as_json:
        emit_json([o.to_dict() for o in outcomes])
    else:
        table(["scenario", "bug class", "caught", "reason"],
              [[o.scenario.name, o.scenario.bug_class, "yes" if o.caught else "NO", o.reason] for o in outcomes],
              notes=("reason",))
        classes = {o.scenario.bug_class for o in outcomes if o.caught}
        say(f"{'PASS' if caught == len(outcomes) else 'FAIL'}: {caught} of {len(outcomes)} scenarios caught, "
            f"{len(classes)} of {len(BUG_CLASSES)} bug classes")
    return 0 if caught == len(outcomes) else 1
