"""Issue 55 deliver 5, the mutation round on tpsim/app/remedies.py (the fixes triage prints, each replayed): bugs
planted one at a time that the tests covering remedies (test_advice, test_triage_served_flags, test_release_advice,
test_triage) let through. Each test names its planted bug and fails with it in place (checked by planting it).
Each triage runs once for the module, in process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.app.asks import EngineAsk
from tpsim.app.remedies import Remedy, _best, _flag_upgrade, _merged, remedies_for
from tpsim.app.triage_request import TriageRequest, run_triage
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.profiles import registry
from tpsim.profiles.findings import Kind
from tpsim.profiles.profile import Served
from tpsim.profiles.registry import later_profiles

DRAFT = str(BUILTIN_CONFIGS / "scenarios" / "tiny-draft-nested-ids.json")


def triaged(server: str, train: str = "specforge", **flags):
    served = Served(server=server, **flags)
    return run_triage(TriageRequest(server, EngineAsk(served, train=train), draft_config=DRAFT, model="tiny"))


@pytest.fixture(scope="module")
def pd():
    """triage of sglang@0.5.1 under PD disaggregation (its hand-off buffer sized before #9976: a pd-handoff finding)
    on tiny, radix cache off, fixes replayed."""
    return triaged("sglang@0.5.1", disaggregated=True, radix_cache=False)


def _finding(result, kind: Kind):
    return next(f for f in result.t.findings if f.kind is kind)


def test_a_fix_never_asks_for_a_release_candidate(pd):
    """Planted bug: the release-candidate filter dropped from the first release that clears a served flag's finding:
    0.5.1's pd-handoff fix became `serve with sglang@0.5.2rc2 or later`. A fix names a release a user is asked to
    serve: never an rc (registry.RELEASES lists 0.5.2rc0 .. rc2 between 0.5.1 and 0.5.2), and, of the others, the
    first after the served one whose own behaviour clears the finding."""
    f = _finding(pd, Kind.PD_HANDOFF)
    up = _flag_upgrade(pd.t, f.kind)
    assert up is not None and up.release is not None
    version = up.release.partition(":")[0].partition("@")[2]
    assert "rc" not in version and "rc" not in up.text, up.text
    between = [r for r in registry.RELEASES["sglang"] if
               registry.version_key("0.5.1") < registry.version_key(r) < registry.version_key(version)]
    assert any("rc" in r for r in between), between  # teeth: release candidates lie between


@pytest.fixture(scope="module")
def radix():
    """triage of sglang@0.5.2 (its radix cache keyed by tokens: a prefix-cache finding) on tiny, fixes replayed."""
    return triaged("sglang@0.5.2")


def test_the_radix_flag_fix_is_replayed_with_the_radix_cache_off(radix):
    """Planted bug: Remedy.apply dropped radix_off (the replay of `serve with --disable-radix-cache` served with the
    cache on, so where no release clears a prefix-cache finding, the flag was reported as not clearing it either).
    Applied, each switch a remedy names is in the inputs replayed, and that replay has no prefix-cache finding."""
    from tpsim.app.triage import triage
    f = _finding(radix, Kind.PREFIX_CACHE)
    flag = next(r for r in remedies_for(radix.t, f) if r.radix_off)
    applied = flag.apply(radix.t.inputs)
    assert radix.t.inputs.served.radix_cache and not applied.served.radix_cache
    assert Kind.PREFIX_CACHE not in {g.kind for g in triage(applied).findings}



SWITCHES = (Remedy("remove use_aux_hidden_state: false from eagle_config", capture_on=True),
            Remedy("serve with --disable-radix-cache", radix_off=True),
            Remedy("serve without pipeline parallelism (--pp 1)", pp_off=True))
SAID = ("use_aux_hidden_state", "--disable-radix-cache", "pipeline parallelism")


@settings(max_examples=25, deadline=None)
@given(switches=st.sets(st.integers(0, 2)), upgrade=st.booleans(), which=st.integers(0, 3))
@example(switches={1}, upgrade=True, which=0)  # the radix flag beside an upgrade
def test_a_plan_says_exactly_the_switches_it_applies(radix, switches, upgrade, which):
    """Planted bug: a plan that upgrades the server still saying `serve with --disable-radix-cache` (the change it
    applies and replays keeps the cache on: a later release's own behaviour is what clears the finding). What a plan
    prints is what it replays: each switch is in its text exactly when the change applies it."""
    later = later_profiles(radix.t.serve)
    server = later[which % len(later)] if upgrade else None
    pool = [SWITCHES[i] for i in sorted(switches)] + ([Remedy("upgrade", server=server)] if server else [])
    change = _merged(radix.t, pool, server)
    if change is None:
        assert not pool
        return
    applied = (change.capture_on, change.radix_off, change.pp_off)
    assert all((said in change.text) is on for said, on in zip(SAID, applied)), (change.text, applied)
    assert change.radix_off is (1 in switches and server is None)


@pytest.mark.parametrize("server", ["sglang@0.5.12", "vllm@0.34.0"])
def test_a_plan_says_the_trained_ids_are_restored_exactly_when_it_writes_them(server):
    """Planted bug: the plan's ", the ids training used, restored" dropped (each fix it merges said it; the plan did
    not). tiny's draft config holds ids 1, 3, 5, training used 1, 2, 5: the plan writes ids back, and says they are
    the ids training used, restored, exactly when the ids it writes are those (SGLang reads them as training wrote
    them; vLLM numbers them one further on: 2, 3, 6 capture the same layers, written as other ids)."""
    result = triaged(server, train="specforge-ids:1,2,5")
    change = result.plan.change
    assert change.ids is not None, change.text
    assert ("the ids training used, restored" in change.text) is (change.ids == (1, 2, 5)), change.text
    assert (change.ids == (1, 2, 5)) is server.startswith("sglang")  # both cases drawn


@settings(max_examples=25, deadline=None)
@given(left=st.lists(st.integers(1, 3), min_size=2, max_size=4))
@example(left=[2, 1, 1])  # a tie between the two later upgrades
def test_of_plans_leaving_as_many_findings_the_least_disruptive_wins(radix, left):
    """Planted bug: the plan's candidates compared with <= (on a tie in what they leave, the later, more disruptive
    upgrade replaced the earlier). Candidates are tried oldest upgrade first; none clearing here (each replay, stood
    in for, leaves `left` findings), the plan is the first of those leaving the fewest."""
    later = later_profiles(radix.t.serve)[:len(left)]
    pool = [Remedy(f"upgrade {i}", server=q) for i, q in enumerate(later)]
    tried = {_merged(radix.t, pool, q).text: SimpleNamespace(findings=["finding"] * n) for q, n in zip(later, left)}
    best = _best(radix.t, pool, tried, None)
    assert best.change.server is later[left.index(min(left))], (best.change.text, left)
