"""Issue 51, deliver 2: advice checked as a whole, not case by case. Over every profile of every line (engine ×
model file × version) and every kind of fix that names a release or a key:

- an upgrade names the first release whose profile has the behaviour the fix relies on (no release read between
  the served one and it has it), that behaviour rests on code read at or unchanged up to that release (the
  fingerprints' READ or SAME, not extrapolated), and the fix names its PR where the profile knows one;
- a remedy search offers every later profile that has the behaviour, oldest first, not only the first;
- a served flag's fix (radix cache, PD hand-off, DBO, the capture-only mode) names the first release whose own
  behaviour clears it, read there, with its PR;
- ids written where the hint says are the ids that release reads."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim.app.remedies import _every, _serve_text
from tpsim.profiles import fingerprints, registry
from tpsim.profiles.capture_only import CAPTURE_ONLY
from tpsim.profiles.draft import read_ids, write_ids, write_ids_hint
from tpsim.profiles.fingerprints import Status
from tpsim.profiles.pd_versions import PD
from tpsim.profiles.prefix import RADIX
from tpsim.profiles.profile import EmbedId, Gather, GraphIds, Site
from tpsim.profiles.ubatch import UBATCH

ENGINE_LINES = [ln for ln in registry.LINES if ln.engine in ("sglang", "vllm")]
# the behaviours a version fix relies on: (the field, whether a profile has it given the served profile)
UPGRADES = {
    "embed": lambda p, q: q.behaviour.embed.value is EmbedId.CAPTURED,
    "graphs": lambda p, q: q.behaviour.graphs is not None and q.behaviour.graphs.value is GraphIds.CONFIG,
    "wiring": lambda p, q: q.behaviour.wiring != p.behaviour.wiring,
    # the served mode's (tpsim.profiles.served.fixed_in): all-reduce fusion, DeepEP's token-scattered stream
    "site": lambda p, q: q.behaviour.site.value is Site.AFTER_FUSED_ADD,
    "scattered": lambda p, q: q.behaviour.scattered is not None and q.behaviour.scattered.value is Gather.GATHERED,
}
CLASSES = {(ln.engine, ln.family): fingerprints.classify_line(ln) for ln in ENGINE_LINES}


def _cases():
    for ln in ENGINE_LINES:
        for p in ln.profiles():
            for field in UPGRADES:
                yield pytest.param(ln, p, field, id=f"{p.name}-{field}")


@pytest.mark.parametrize("line,served,field", list(_cases()))
def test_an_upgrade_names_the_first_release_that_has_it_read_there_with_its_pr(line, served, field):
    def has(q):
        return UPGRADES[field](served, q)
    offered = _every(served, has)
    later = registry.later_profiles(served)
    assert [q.name for q in offered] == [q.name for q in later if has(q)]  # every one, oldest first
    if not offered or (field != "wiring" and has(served)):  # the served version has it: no such finding there
        return
    first = offered[0]
    release = first.versions.since.release
    assert release, f"{first.name} opens at a merge date, not a release: the fix cannot name one"
    mine = CLASSES[(line.engine, line.family)]
    between = [c for c in mine if registry.version_key(served.versions.since.release if served.versions.since
                                                       else mine[0].release) <= registry.version_key(c.release)
               < registry.version_key(release)]
    assert not [c.release for c in between if has(c.profile)], "an earlier release has it"
    there = next(c for c in mine if c.release == release)
    cited = getattr(first.behaviour, field)
    verdicts = [v for v in there.verdicts if v.source == cited.source]
    assert verdicts and all(v.status in (Status.READ, Status.SAME) for v in verdicts), \
        (release, [(v.status, str(v.source)) for v in verdicts])
    text = _serve_text(first)
    assert text.startswith(f"serve with {line.engine}@{release} or later")
    assert not first.versions.since.prs or first.versions.since.label in text


FLAG_HISTORIES = {"radix": (RADIX, lambda v: v.name != "TOKENS"), "pd": (PD, None), "dbo": (UBATCH, lambda v: not v.fails),
                  "capture-only": (CAPTURE_ONLY, lambda v: v.served)}


@pytest.mark.parametrize("name", sorted(FLAG_HISTORIES))
def test_a_served_flag_fix_names_the_first_release_whose_own_behaviour_clears_it(name):
    history, ok = FLAG_HISTORIES[name]
    if ok is None:  # the PD hand-off: cleared per draft width; every change is one the fix may name
        ok = lambda v: True  # noqa: E731
    read = sorted((r for r in history.releases if "rc" not in r and history.read(f"{history.engine}@{r}")),
                  key=registry.version_key)
    for v in read:
        held = history.at(f"{history.engine}@{v}")
        change = held.later(ok)
        after = [r for r in read if registry.version_key(r) > registry.version_key(v)]
        first = next((r for r in after if ok(history.at(f"{history.engine}@{r}").value)), None)
        assert (change is None) == (first is None) or ok(held.value), (v, change, first)
        if change is None or ok(held.value):
            continue
        if change.release is not None:  # the first release named is the first read whose own behaviour has it
            assert first == change.release, (v, first, change.release)
        else:  # known by its merge date: the first release after the merge (what _flag_upgrade serves)
            assert change.merged is not None and history.releases[first] >= change.merged, (v, first, change)
        text = held.upgrade(change)
        assert (change.release is None or text.startswith(f"{change.release} or later")) and \
            (not change.prs or change.label in text), text


WRITERS = [p for ln in ENGINE_LINES for p in ln.profiles() if p.behaviour.config.value.keys]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(WRITERS), st.lists(st.integers(0, 60), min_size=3, max_size=3),
       st.sampled_from([{}, {"eagle_config": {}}, {"eagle_aux_hidden_state_layer_ids": [9, 9, 9]}]))
def test_ids_written_where_the_hint_says_are_the_ids_that_release_reads(profile, ids, config):
    raw = json.loads(json.dumps(config))
    write_ids(raw, profile, ids)
    assert read_ids(profile, raw).ids == ids
    hint = write_ids_hint(profile, ids)
    written = json.loads("{" + hint.removeprefix("write ").split(" in the draft config")[0] + "}")
    again = json.loads(json.dumps(config))
    for k, v in written.items():  # the hint applied as a user would: merged into the config
        again[k] = {**again.get(k, {}), **v} if isinstance(v, dict) else v
    assert read_ids(profile, again).ids == ids, hint
