"""Conventions, as pure functions: defaults agree, translation round-trips, ranges are enforced."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strategies import ID_RANGES
from tpsim.capture import Position, PositionKind
from tpsim.profiles.conventions import default_ids, ids_for, resolve
from tpsim.base.errors import UsageError

LOOP_ORDER = {"sglang", "sglang-boundary", "vllm", "eagle"}  # capture ascending, each position once
DEFAULT_CONVENTIONS = ["sglang", "sglang-boundary", "vllm", "specforge", "eagle"]


def capture_order(conv, positions):
    return sorted(set(positions), key=Position.sort_key) if conv in LOOP_ORDER else list(positions)


@given(L=st.integers(5, 200))
def test_defaults_select_the_same_tensors(L):
    """The four defaults (SGLang's, vLLM's, SpecForge's, EAGLE's) are out(1), out(L//2-1), out(L-4)."""
    want = [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, L // 2 - 1), Position(PositionKind.OUT, L - 4)]
    for conv in DEFAULT_CONVENTIONS:
        got = resolve(conv, None, L).positions
        assert set(got) == set(want), conv
        if L >= 7:  # three distinct layers: the concatenations are identical too
            assert got == want, conv


def test_sglang_default_is_not_shifted_but_explicit_ids_are():
    assert resolve("sglang", None, 61).internal == [2, 30, 58]
    assert resolve("sglang", [2, 30, 58], 61).internal == [3, 31, 59]  # PR #23569's review point
    assert resolve("sglang", [1, 29, 57], 61).positions == resolve("sglang", None, 61).positions


@example(src="sglang", ids=[-1, 2, 30], L=61, dst="vllm")
@given(src=st.sampled_from(sorted(ID_RANGES)), L=st.integers(1, 80), dst=st.sampled_from(sorted(ID_RANGES) + ["sglang-boundary"]),
       ids=st.lists(st.integers(-2, 90), min_size=1, max_size=5))
def test_translation_round_trips(src, ids, L, dst):
    lo, hi = ID_RANGES[src](L)
    ids = [lo + (i % (hi - lo + 1)) for i in ids]  # fold into the valid range
    positions = resolve(src, ids, L).positions
    try:
        translated = ids_for(dst, positions, L)
    except UsageError as e:  # only genuinely unreachable positions may fail, and the error says why
        assert "cannot" in str(e)
        return
    assert resolve(dst, translated, L).positions == capture_order(dst, positions)
    back = ids_for(src, resolve(dst, translated, L).positions, L)
    assert resolve(src, back, L).positions == capture_order(src, resolve(dst, translated, L).positions)


@given(conv=st.sampled_from(sorted(ID_RANGES)), L=st.integers(1, 80), j=st.integers(-100, 200))
def test_ids_outside_the_range_are_errors_that_name_it(conv, L, j):
    lo, hi = ID_RANGES[conv](L)
    if lo <= j <= hi:
        assert len(resolve(conv, [j], L).positions) == 1
    else:
        with pytest.raises(UsageError, match=r"valid|negative"):
            resolve(conv, [j], L)


def test_worked_examples_deepseek_v3():
    L = 61
    assert [str(p) for p in resolve("sglang", [-1, 2, 30], L).positions] == ["embed", "out(2)", "out(30)"]
    assert [str(p) for p in resolve("specforge", [1, 29, 57], L).positions] == ["out(1)", "out(29)", "out(57)"]
    # vLLM given SpecForge's ids at top level: shifted by one layer (vLLM PR #43671's failure class)
    assert [str(p) for p in resolve("vllm", [1, 29, 57], L).positions] == ["out(0)", "out(28)", "out(56)"]
    assert [str(p) for p in resolve("hf", [0, 61], L).positions] == ["embed", "final"]
    assert resolve("vllm", [61], L).positions == [Position(PositionKind.OUT, 60)]
    with pytest.raises(UsageError, match=r"out\(60\) is unreachable.*vllm id 61"):
        resolve("sglang", [60], L)


def test_sglang_boundary_heuristic():
    assert resolve("sglang-boundary", [1, 29, 57], 61).internal == [2, 30, 58]  # first id 1: +1
    assert resolve("sglang-boundary", [2, 30, 58], 61).internal == [2, 30, 58]  # else as-is
    with pytest.raises(UsageError, match="silently skip"):
        resolve("sglang-boundary", [-1, 2], 61)


def test_loop_order_dedupes_list_order_keeps():
    assert len(resolve("sglang", [2, 2, 5], 8).positions) == 2
    assert [str(p) for p in resolve("vllm", [5, 1], 8).positions] == ["out(0)", "out(4)"]
    assert [str(p) for p in resolve("specforge", [4, 0, 4], 8).positions] == ["out(4)", "out(0)", "out(4)"]


def test_unknown_convention_lists_the_valid_ones():
    with pytest.raises(UsageError, match="sglang, sglang-boundary, vllm"):
        default_ids("megatron", 8)


# The table in the conventions docstring, written out independently: convention -> (the +1 ids get
# given a list, the valid internal range on L layers, ascending?, internal -> position).
def _before(b, L):
    return Position.at_boundary(b)


def _hf(j, L):
    return Position(PositionKind.FINAL) if j == L else Position.at_boundary(j)


TABLE = {
    "sglang": (lambda ids: 1, lambda L: (0, L - 1), True, _before),
    "sglang-boundary": (lambda ids: 1 if ids[0] == 1 else 0, lambda L: (0, L - 1), True, _before),
    "vllm": (lambda ids: 0, lambda L: (0, L), True, _before),
    "specforge": (lambda ids: 1, lambda L: (1, L), False, _before),
    "output-of": (lambda ids: 1, lambda L: (1, L), False, _before),
    "hf": (lambda ids: 0, lambda L: (0, L), False, _hf),
    "eagle": (lambda ids: 0, lambda L: (0, L - 1), True, _before),
}


@st.composite
def _table_cases(draw):
    conv = draw(st.sampled_from(sorted(TABLE)), label="convention")
    L = draw(st.integers(1, 40), label="L")
    ids = draw(st.lists(st.integers(-2, L + 2), min_size=1, max_size=5), label="ids")
    return conv, L, ids


@example(c=("sglang-boundary", 5, [1, -1]))
@example(c=("specforge", 4, [3, 3, 0]))
@example(c=("hf", 3, [3, 0]))
@given(c=_table_cases())
def test_positions_follow_the_conventions_table(c):
    """For every convention and drawn ids, the positions are the table's (and ids outside its valid
    range are refused)."""
    conv, L, ids = c
    shift, valid, ascending, where = TABLE[conv]
    lo, hi = valid(L)
    internal = [j + shift(ids) for j in ids]
    if not all(lo <= i <= hi for i in internal):
        with pytest.raises(UsageError):
            resolve(conv, ids, L)
        return
    want = [where(i, L) for i in internal]
    if ascending:
        want = sorted(set(want), key=Position.sort_key)
    assert resolve(conv, ids, L).positions == want


def _exhaustive(profile, p: Position, L: int) -> int | None:
    """ids_for_position by trying every id -1..L+1 in order (what it did before it was bounded)."""
    from tpsim.profiles.profile import Numbering
    from tpsim.profiles.replay import Fate, internal_ids, slot
    n = profile.behaviour.numbering.value
    if profile.behaviour.config.value.hard_coded:
        return None
    if p.kind is PositionKind.FINAL:
        return L if n is Numbering.HIDDEN_STATES_INDEX else None
    for j in range(-1, L + 2):
        if n is Numbering.PLUS_ONE_IF_FIRST_IS_1 and j == 1:
            continue
        s = slot(profile, 0, j, internal_ids(n, [j], L)[0], L)
        if s.fate is Fate.CAPTURED and s.position == p and s.internal == p.boundary:
            return j
    return 1 if n is Numbering.PLUS_ONE_IF_FIRST_IS_1 and p.boundary == 2 else None


@given(L=st.integers(1, 40), data=st.data())
def test_the_inverse_tries_only_the_ids_that_can_reach_a_boundary(L, data):
    """Every numbering tests id j as j or j + 1, so ids_for_position looks at two ids, not L + 3 (a
    `resolve --num-layers 1000000000` from the fuzz ran for ever), and finds what trying all finds."""
    from tpsim.profiles.conventions import Convention
    from tpsim.profiles.inverse import ids_for_position
    from tpsim.profiles.registry import all_profiles
    profile = data.draw(st.sampled_from([c.profile for c in Convention] + all_profiles()), label="profile")
    b = data.draw(st.integers(0, L), label="boundary")
    for p in (Position.at_boundary(b), Position(PositionKind.FINAL)):
        assert ids_for_position(profile, p, L) == _exhaustive(profile, p, L), (profile.name, str(p))


def test_resolve_on_a_billion_layers_answers():
    res = resolve("sglang", [1, 2], 10**9)
    assert [str(p) for p in res.positions] == ["out(1)", "out(2)"]
    assert ids_for("vllm", res.positions, 10**9) == [2, 3]
