"""A model class that declares EAGLE-3 support and never captures (vLLM's Qwen3.5 conditional-generation class,
tpsim/profiles/vllm.py QWEN3_5_VLM): up to 0.17.1 its forward ignores the ids, 0.18.0 .. 0.19.1 its setter refuses
at start-up, from 0.20.0 it captures as the EagleModelMixin models do. Replay, findings and triage's replayed fix."""

from __future__ import annotations

from hypothesis import example, given, strategies as st

from clirun import run_cli
from tpsim.app.scenarios import BUILTIN_CONFIGS
from tpsim.profiles.findings import Kind, replay_findings
from tpsim.profiles.profile import Wiring
from tpsim.profiles.registry import lookup
from tpsim.profiles.replay import Fate, replay

IGNORED = ["vllm@0.17.0", "vllm@0.17.1"]
REFUSED = ["vllm@0.18.0", "vllm@0.18.1", "vllm@0.19.1"]
CAPTURES = ["vllm@0.20.0", "vllm@0.25.0", "vllm@0.29.0", "vllm@0.34.0"]


@example(version="vllm@0.17.1", L=32, ids=None)
@example(version="vllm@0.19.1", L=32, ids=[2, 16, 29])
@given(version=st.sampled_from(IGNORED + REFUSED + CAPTURES), L=st.integers(4, 64),
       ids=st.none() | st.lists(st.integers(0, 70), min_size=1, max_size=5))
def test_a_class_that_never_takes_the_ids_captures_nothing_and_says_so(version, L, ids):
    """Ignored or refused: no position for any ids, every slot IGNORED / REFUSED, exactly one finding of the
    class (not one per slot) citing the model file; from 0.20.0 the capture is the dense mixin line's."""
    p = lookup(f"{version}:qwen3_5", "qwen3_5")
    rep = replay(p, ids, L)
    if version in CAPTURES:
        assert p.behaviour.captures and rep.positions == replay(lookup(f"{version}:llama", "llama"), ids, L).positions
        return
    fate = Fate.IGNORED if version in IGNORED else Fate.REFUSED
    assert rep.positions == [] and rep.slots and all(s.fate is fate for s in rep.slots)
    found = replay_findings(rep, 4096)
    assert [f.kind for f in found] == [Kind.CAPTURE_IGNORED if version in IGNORED else Kind.ENGINE_REFUSES]
    assert f"0 of {len(rep.slots)} slots" in found[0].cause or "EagleModelMixin" in found[0].cause
    assert p.behaviour.wiring.value is (Wiring.IGNORED if version in IGNORED else Wiring.SETTER_REFUSES)


def test_triage_replays_the_upgrade_and_prints_only_what_cleared():
    draft, model = BUILTIN_CONFIGS / "scenarios" / "qwen3.5-9b-draft.json", BUILTIN_CONFIGS / "qwen3.5-9b.yaml"
    args = ["triage", "--model", str(model), "--draft-config", str(draft), "--tp", "1"]
    old = run_cli(*args, "--server", "vllm@0.17.1")
    assert old.returncode == 1 and "the model file never captures" in old.stdout, old
    # issue 51, item 4: 0.18.0 refuses the launch, so the search goes on to 0.20.0, which captures
    assert "serve with vllm@0.20.0 or later" in old.stdout and "fix replayed: the finding clears" in old.stdout, old
    mid = run_cli(*args, "--server", "vllm@0.19.1")
    assert mid.returncode == 1 and "Model instance must inherit from EagleModelMixin" in mid.stdout, mid
    assert "serve with vllm@0.20.0 or later" in mid.stdout, mid.stdout  # replayed: it captures there
    new = run_cli(*args, "--server", "vllm@0.20.0")
    assert new.returncode == 0, new
