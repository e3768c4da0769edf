"""The cost of an MTP feed mismatch, measured (issue 53 deliver 2): the committed MTP-style head for SmolLM2-135M,
trained on the final post-norm hidden, accepts fewer tokens when fed the pre-norm block output at step 0, by more
than two standard errors of the paired difference, and the committed result says the same (~20 s on 2 cores)."""

from __future__ import annotations

import json

from clirun import ROOT
from tpsim.app.mtp_acceptance import measure

HEAD = ROOT / "configs" / "drafts" / "smollm2-135m-mtp"
PROMPTS = ROOT / "configs" / "prompts" / "smollm2-135m.json"
RESULT = ROOT / "benchmarks" / "results" / "mtp-feedback-cpu.json"


def test_pre_norm_at_step_0_drops_acceptance():
    m = measure(HEAD, PROMPTS, k=3)
    mean, se = m.difference("step0-pre-norm")
    assert m.trained.rounds > 500
    assert mean < -2 * se, (mean, se)
    assert m.fed["step0-pre-norm"].length < m.trained.length
    committed = json.loads(RESULT.read_text())
    assert committed["step0-pre-norm"]["paired_difference"] == round(mean, 4)
    assert committed["trained"]["acceptance_length"] == round(m.trained.length, 4)
