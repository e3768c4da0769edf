"""Conventions, as pure functions: defaults agree, translation round-trips, ranges are enforced."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from strategies import ID_RANGES
from tpsim.capture import Position, PositionKind
from tpsim.profiles.conventions import default_ids, ids_for, resolve
from tpsim.base.errors import UsageError

LOOP_ORDER = {"sglang-ids", "sglang-boundary-ids", "vllm-ids", "eagle-ids"}  # capture ascending, each position once
DEFAULT_CONVENTIONS = ["sglang-ids", "sglang-boundary-ids", "vllm-ids", "specforge-ids", "eagle-ids"]


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
    assert resolve("sglang-ids", None, 61).internal == [2, 30, 58]
    assert resolve("sglang-ids", [2, 30, 58], 61).internal == [3, 31, 59]  # PR #23569's review point
    assert resolve("sglang-ids", [1, 29, 57], 61).positions == resolve("sglang-ids", None, 61).positions


@example(src="sglang-ids", ids=[-1, 2, 30], L=61, dst="vllm-ids")
@given(src=st.sampled_from(sorted(ID_RANGES)), L=st.integers(1, 80),
       dst=st.sampled_from(sorted(ID_RANGES) + ["sglang-boundary-ids"]),
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
    assert [str(p) for p in resolve("sglang-ids", [-1, 2, 30], L).positions] == ["embed", "out(2)", "out(30)"]
    assert [str(p) for p in resolve("specforge-ids", [1, 29, 57], L).positions] == ["out(1)", "out(29)", "out(57)"]
    # vLLM given SpecForge's ids at top level: shifted by one layer (vLLM PR #43671's failure class)
    assert [str(p) for p in resolve("vllm-ids", [1, 29, 57], L).positions] == ["out(0)", "out(28)", "out(56)"]
    assert [str(p) for p in resolve("hf-ids", [0, 61], L).positions] == ["embed", "final"]
    assert resolve("vllm-ids", [61], L).positions == [Position(PositionKind.OUT, 60)]
    with pytest.raises(UsageError, match=r"out\(60\) is unreachable.*vllm-ids 61"):
        resolve("sglang-ids", [60], L)


def test_sglang_boundary_heuristic():
    assert resolve("sglang-boundary-ids", [1, 29, 57], 61).internal == [2, 30, 58]  # first id 1: +1
    assert resolve("sglang-boundary-ids", [2, 30, 58], 61).internal == [2, 30, 58]  # else as-is
    with pytest.raises(UsageError, match="silently skip"):
        resolve("sglang-boundary-ids", [-1, 2], 61)


def test_loop_order_dedupes_list_order_keeps():
    assert len(resolve("sglang-ids", [2, 2, 5], 8).positions) == 2
    assert [str(p) for p in resolve("vllm-ids", [5, 1], 8).positions] == ["out(0)", "out(4)"]
    assert [str(p) for p in resolve("specforge-ids", [4, 0, 4], 8).positions] == ["out(4)", "out(0)", "out(4)"]


def test_unknown_convention_lists_the_valid_ones():
    with pytest.raises(UsageError, match="sglang-ids, sglang-boundary-ids, vllm-ids"):
        default_ids("megatron", 8)


# The table in the conventions docstring, written out independently: convention -> (the +1 ids get
# given a list, the valid internal range on L layers, ascending?, internal -> position).
def _before(b, L):
    return Position.at_boundary(b)


def _hf(j, L):
    return Position(PositionKind.FINAL) if j == L else Position.at_boundary(j)


TABLE = {
    "sglang-ids": (lambda ids: 1, lambda L: (0, L - 1), True, _before),
    "sglang-boundary-ids": (lambda ids: 1 if ids[0] == 1 else 0, lambda L: (0, L - 1), True, _before),
    "vllm-ids": (lambda ids: 0, lambda L: (0, L), True, _before),
    "specforge-ids": (lambda ids: 1, lambda L: (1, L), False, _before),
    "output-of": (lambda ids: 1, lambda L: (1, L), False, _before),
    "hf-ids": (lambda ids: 0, lambda L: (0, L), False, _hf),
    "eagle-ids": (lambda ids: 0, lambda L: (0, L - 1), True, _before),
}


@st.composite
def _table_cases(draw):
    conv = draw(st.sampled_from(sorted(TABLE)), label="convention")
    L = draw(st.integers(1, 40), label="L")
    ids = draw(st.lists(st.integers(-2, L + 2), min_size=1, max_size=5), label="ids")
    return conv, L, ids


@example(c=("sglang-boundary-ids", 5, [1, -1]))
@example(c=("specforge-ids", 4, [3, 3, 0]))
@example(c=("hf-ids", 3, [3, 0]))
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
    res = resolve("sglang-ids", [1, 2], 10**9)
    assert [str(p) for p in res.positions] == ["out(1)", "out(2)"]
    assert ids_for("vllm-ids", res.positions, 10**9) == [2, 3]


# --- names: a convention's is never a profile's ------------------------------------------------

OPTIONS = st.sampled_from(["--train", "--serve", "--convention"])
ID_TEXT = st.one_of(st.none(), st.lists(st.integers(-3, 200), min_size=1, max_size=5))


def _text(ids):
    return "default" if ids is None else ",".join(map(str, ids))


def test_no_convention_is_named_like_a_profile():
    """`--convention sglang` and `--server sglang` once numbered ids differently under one name: no
    convention's name (nor alias) is an engine's, a trainer's or a registry alias (either side)."""
    from tpsim.profiles import registry
    from tpsim.profiles.conventions import ALIASES, CONVENTIONS, PROFILE_NAMES, Convention
    profiles = {*registry.ENGINES, *registry.TRAINERS, *registry.ALIASES, *registry.ALIASES.values()}
    assert set(CONVENTIONS) == {c.value for c in Convention} | set(ALIASES)
    assert not set(CONVENTIONS) & profiles
    assert all(c.value.endswith("-ids") for c in Convention)
    # the refusal's table: each old name is a profile's, and each convention has exactly one
    assert set(PROFILE_NAMES) <= {*registry.ENGINES, *registry.ALIASES}
    assert sorted(c.value for c, _ in PROFILE_NAMES.values()) == sorted(c.value for c in Convention)


@given(old=st.sampled_from(["sglang", "sglang-boundary", "vllm", "specforge", "hf", "eagle"]), ids=ID_TEXT,
       option=OPTIONS)
def test_the_new_spelling_means_what_the_old_one_did(old, ids, option):
    """`sglang:IDS` was Convention.SGLANG with IDS: `sglang-ids:IDS` is, and `sglang:IDS` is refused
    with that spelling in one line."""
    from tpsim.profiles.conventions import Convention, check_convention, parse_convention_ids
    before = Convention[old.upper().replace("-", "_")]  # the member the bare name was the value of
    new = f"{old}-ids"
    assert parse_convention_ids(f"{new}:{_text(ids)}", option) == (before, ids)
    assert check_convention(new) is before
    for refuse in (lambda: parse_convention_ids(f"{old}:{_text(ids)}", option),
                   lambda: check_convention(old, option, f":{_text(ids)}")):
        with pytest.raises(UsageError) as e:
            refuse()
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{option} {old}:{_text(ids)}: "), msg
        assert f'"{old}" names ' in msg and msg.endswith(f"write {option} {new}:{_text(ids)}"), msg
    with pytest.raises(UsageError, match=f"the idealised convention is {new}$"):
        check_convention(old)  # the Python API: no option to spell out


def test_the_refusal_quotes_any_text_as_written():
    from tpsim.profiles.conventions import parse_convention_ids
    with pytest.raises(UsageError, match=r"^--serve sglang:\{: .* write --serve sglang-ids:\{$"):
        parse_convention_ids("sglang:{", "--serve")  # once a str.format of the user's text
    with pytest.raises(UsageError, match=r'^--serve sglang: "sglang" names .* write --serve sglang-ids:IDS$'):
        parse_convention_ids("sglang", "--serve")


def test_output_of_stays_an_alias():
    from tpsim.profiles.conventions import Convention, parse_convention_ids
    assert parse_convention_ids("output-of:1,29,57", "--train") == (Convention.SPECFORGE, [1, 29, 57])


@given(name=st.sampled_from(["sglang-ids", "sglang-boundary-ids", "vllm-ids", "specforge-ids", "output-of",
                             "hf-ids", "eagle-ids"]),
       tail=st.sampled_from(["", "@0.5.12", ":llama", "@latest:deepseek_v3"]),
       option=st.sampled_from(["--server", "--train"]))
def test_a_convention_where_a_profile_is_taken_is_refused_with_the_profile(name, tail, option):
    from tpsim.profiles import registry
    from tpsim.profiles.conventions import refuse_convention_as_profile
    with pytest.raises(UsageError) as e:
        refuse_convention_as_profile(name + tail, option)
    msg = str(e.value)
    profile = msg.rpartition(f"write {option} ")[2]
    assert "\n" not in msg and msg.startswith(f'{option} {name}{tail}: "{name}" names an idealised convention')
    assert profile.endswith(tail) and profile.removesuffix(tail) in {*registry.ENGINES, *registry.ALIASES}
    for engine in (*registry.ENGINES, *registry.ALIASES):  # a profile's name passes untouched
        assert refuse_convention_as_profile(engine + tail, option) == engine + tail
