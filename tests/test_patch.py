"""`+embed`: a release that crashes on an embedding id, named as patched to capture the embedding output.
Only the embedding slot changes; every other slot is the release's own; the patch's shape is cited to the
first later release of the same model file that guards the case."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from tpsim.capture.positions import PositionKind
from tpsim.profiles.profile import EmbedId, Patch
from tpsim.profiles.registry import all_profiles, later_profiles, lookup
from tpsim.profiles.replay import replay

CRASHING = sorted({p.name for p in all_profiles() if p.behaviour.embed.value is EmbedId.CRASHES and
                   any(q.behaviour.embed.value is EmbedId.CAPTURED for q in later_profiles(p))})


def test_some_releases_crash_on_an_embedding_id():
    assert "sglang@0.5.11:deepseek_v3" in CRASHING


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(CRASHING), L=st.integers(4, 64), ids=st.lists(st.integers(-1, 70), min_size=1, max_size=4))
@example(name="sglang@0.5.11:deepseek_v3", L=61, ids=[-1, 2, 30])
@example(name="sglang@0.5.13:deepseek_v2", L=4, ids=[0])  # 0.5.13 numbers without +1: id 0 is its embedding id
def test_embed_patch_changes_only_the_embedding_slot(name, L, ids):
    base = lookup(name, "deepseek_v2")
    fixed = lookup(f"{name}+embed", "deepseek_v2")
    assert fixed.patch is Patch.EMBED and fixed.name == f"{base.released}+embed"
    plain, patched = replay(base, ids, L), replay(fixed, ids, L)
    if not plain.crashed:  # no id lands on the embedding: nothing changes
        assert (plain.positions, plain.failure) == (patched.positions, patched.failure)
    else:
        assert not patched.crashed and PositionKind.EMBED in [p.kind for p in patched.positions]
        rest = [j for j, s in zip(ids, patched.slots) if s.position is None or s.position.kind is not PositionKind.EMBED]
        assert [p for p in patched.positions if p.kind is not PositionKind.EMBED] == replay(base, rest, L).positions
    later = next(q for q in later_profiles(base) if q.behaviour.embed.value is EmbedId.CAPTURED)
    src = fixed.behaviour.embed.source
    assert (src.path, src.ref) == (later.behaviour.embed.source.path, later.behaviour.embed.source.ref)
    assert "shape of the local patch" in src.note


@pytest.mark.parametrize("server,words", [
    ("sglang@0.5.14+embed", "does not crash on an embedding id"),
    ("sglang@0.5.12+foo", "unknown patch +foo"),
])
def test_a_patch_that_does_not_apply_is_refused(server, words):
    assert_one_line_error(run_cli("resolve", "--server", server, "--layers", "-1,2,5", "--model", "tiny"), words)


def test_a_crash_says_how_to_name_a_patched_server():
    r = run_cli("resolve", "--server", "sglang@0.5.12", "--layers", "-1,2,5", "--model", "tiny")
    assert "replay it with --server sglang@0.5.11:deepseek_v2+embed" in r.stdout, r


def test_align_reads_the_trainer_for_the_patched_servers_model():
    """`:deepseek_v3+embed`: the trainer's profile is the one for deepseek_v3, not a model named 'deepseek_v3+embed'."""
    plain = run_cli("align", "--draft-config", "deepseek-v3-edited-ids", "--server", "sglang@0.5.12:deepseek_v3",
                    "--num-layers", "61", "--json")
    patched = run_cli("align", "--draft-config", "deepseek-v3-edited-ids", "--server",
                      "sglang@0.5.12:deepseek_v3+embed", "--num-layers", "61", "--json")
    import json
    assert json.loads(plain.stdout)["train"]["convention"] == json.loads(patched.stdout)["train"]["convention"]
    assert "embedding slot never seen in training" in patched.stdout
