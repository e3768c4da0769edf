"""Every ready-made scenario in configs/scenarios/ runs through `tpsim scenario NAME` and is
caught as its file says (exit code and the reason in the output)."""

from __future__ import annotations

import pytest

from clirun import run_cli
from tpsim.cli.scenario import available, load


def test_there_are_scenarios_for_each_known_failure():
    names = available()
    for prefix in ("align-vllm-top-level-copy", "align-embed-slot-never-trained", "align-default-fallback",
                   "diagnose-capture-before-all-reduce"):
        assert prefix in names


@pytest.mark.parametrize("name", available())
def test_scenario_is_caught(name):
    spec = load(name)
    r = run_cli("scenario", name)
    assert r.returncode == 0, r
    assert f"scenario {name}: caught as expected" in r.stdout, r
    for e in spec.expected():
        assert e in r.stdout


def test_unknown_scenario_is_a_usage_error():
    r = run_cli("scenario", "no-such-case")
    assert r.returncode == 2 and "unknown scenario 'no-such-case'" in r.stderr, r
