"""SGLang's DFlash and DSpark start-up, replayed by tpsim.profiles.block_taps, against SGLang's own config parsers
run from the released wheels (parse_dflash_draft_config, DFlashDraftConfig.resolve_target_layer_ids,
build_target_layer_ids, parse_dspark_draft_config) on drawn draft configs. The glue between them is the runner's
and the draft's code as tpsim.profiles.dflash quotes it (test_dflash_taps checks every quote in every release)."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Any, List, Optional

import pytest
from hypothesis import example, given, settings, strategies as st

from sglang_src import no_sources, released_definitions
from tpsim.app.block_draft import check as check_draft, fixed_config
from tpsim.draft.block import read_block_draft
from tpsim.profiles import dflash as d
from tpsim.profiles.block_taps import taps

DSPARK_CONFIG = "python/sglang/srt/speculative/dspark_components/dspark_config.py"
UTILS_NAMES = ("DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids", "_cfg_get", "_get_text_config",
               "_get_dflash_config", "_parse_optional_int", "DFlashDraftConfig", "parse_dflash_draft_config")
DSPARK_NAMES = ("SUPPORTED_DSPARK_MARKOV_HEAD_TYPES", "DSparkDraftConfig", "_cfg_get", "_get_text_config",
                "_get_nested_config", "_get_dspark_config", "parse_dspark_draft_config")
HIDDEN = 64


def released(release: str):
    typing = {"Any": Any, "List": List, "Optional": Optional}
    u = released_definitions(release, d.UTILS, UTILS_NAMES, Integral=Integral, dataclass=dataclass, **typing)
    if release < "0.5.16":
        return u["parse_dflash_draft_config"], None
    try:
        import msgspec  # DSparkDraftConfig is a msgspec.Struct: the test extra has it, a GPU image may not
    except ImportError:
        no_sources("no msgspec (pip install -e '.[test]')")
    s = released_definitions(release, DSPARK_CONFIG, DSPARK_NAMES, msgspec=msgspec,
                             parse_dflash_draft_config=u["parse_dflash_draft_config"], **typing)
    return u["parse_dflash_draft_config"], s["parse_dspark_draft_config"]


def sglang_starts(release: str, raw: dict, L: int, dspark: bool):
    """What SGLang `release` does with the draft `raw` on a Qwen3 target of `L` layers: (stage, what)."""
    parse_dflash, parse_dspark = released(release)
    try:  # the target runner (spec_aux_hidden_state.py _resolve_dflash_aux_hidden_state)
        cfg = parse_dflash(draft_hf_config=raw)
        ids = cfg.resolve_target_layer_ids(target_num_layers=L, draft_num_layers=cfg.require_num_layers())
        trained = ids
        if dspark:
            own = parse_dspark(draft_hf_config=raw)
            if not own.require_markov():
                raise ValueError("DSPARK requires markov_rank > 0 in the draft config, "
                                 f"got markov_rank={own.markov_rank}.")
            if own.target_layer_ids is not None:
                ids = list(own.target_layer_ids)
    except ValueError as e:
        return "refused", f"ValueError: {e}"
    hooked = [j + 1 for j in ids]  # set_dflash_layers_to_capture (qwen3.py)
    captured = [i - 1 for i in range(L) if i in hooked]  # the layer loop: `if i in self.layers_to_capture`
    n = cfg.require_num_layers()
    if cfg.num_target_layers is not None:  # the draft (models/dflash.py DFlashDraftModel.__init__)
        bound = int(cfg.num_target_layers)
    elif cfg.target_layer_ids is not None and release >= "0.5.18":
        bound = max(cfg.target_layer_ids) + 1
    else:
        bound = n
    try:
        width = len(cfg.resolve_target_layer_ids(target_num_layers=bound, draft_num_layers=n))
    except ValueError as e:
        return "refused", f"ValueError: {e}"
    checkpoint = len(ids if dspark and raw.get("dspark_target_layer_ids") else cfg.target_layer_ids or trained)
    if width != checkpoint:  # load_weights' fc shape check: the checkpoint's fc took the trained count
        return "load", width
    if width != len(captured):  # project_target_hidden, at the first forward
        return "forward", width
    return "serves", (tuple(ids), d.out_of(captured))


def ids_in(L: int):
    """Ids in any order, repeated, some past the target, L - 1 among them."""
    return st.lists(st.integers(0, L + 2), min_size=1, max_size=6)


@st.composite
def drafts(draw, dspark: bool):
    L = draw(st.integers(4, 48))
    raw = {"architectures": ["Qwen3DSparkModel" if dspark else "DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": HIDDEN, "num_hidden_layers": draw(st.integers(1, 6)),
           "dflash_config": {"mask_token_id": 7, "block_size": 16}}
    if draw(st.booleans()):
        raw["dflash_config"]["target_layer_ids"] = draw(ids_in(L))
    if draw(st.booleans()):
        raw["target_layer_ids"] = draw(ids_in(L))
    where = draw(st.sampled_from(["", "nested", "top"]))
    if where:
        (raw["dflash_config"] if where == "nested" else raw)["num_target_layers"] = draw(st.integers(1, 60))
    if dspark:
        if draw(st.booleans()):
            raw["dspark_target_layer_ids"] = draw(ids_in(L))
        rank = draw(st.integers(0, 2))
        place = draw(st.sampled_from(["", "markov_rank", "dspark_markov_rank", "dspark_config", "dflash_config"]))
        if place in ("dspark_config", "dflash_config"):
            raw.setdefault(place, {})["markov_rank"] = rank
        elif place:
            raw[place] = rank
        head = draw(st.sampled_from([None, "vanilla", "Gated", "lstm"]))
        if head is not None:
            raw["markov_head_type"] = head
    return raw, L


def check(release: str, raw: dict, L: int, dspark: bool) -> None:
    got = taps(f"sglang@{release}", read_block_draft(raw, "t"), raw, L, "qwen3", HIDDEN)
    stage, what = sglang_starts(release, raw, L, dspark)
    if stage == "refused":
        assert got.failure == what, (raw, got)
    elif stage == "load":
        assert got.failure.startswith("ValueError: DFLASH fc.weight shape mismatch") and \
            f"num_context_features={what}," in got.failure, (raw, got)
    elif stage == "forward":
        assert got.failure.startswith("ValueError: DFLASH target_hidden feature dim mismatch") and \
            f"num_context_features={what}," in got.failure, (raw, got)
    else:
        assert not got.failure and (got.ids, got.positions) == what, (raw, got, what)


def _dspark(n: int, **keys) -> dict:
    return {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": HIDDEN, "num_hidden_layers": n,
            "dflash_config": {"mask_token_id": 7, "block_size": 16}, "markov_rank": 1, "markov_head_type": "vanilla",
            **keys}


@pytest.mark.parametrize("release", ["0.5.16", "0.5.17", "0.5.18", "0.5.23"])
@settings(max_examples=120, deadline=None)
@given(drawn=drafts(dspark=True))
@example(drawn=(_dspark(4), 4))  # the fallback on 4 layers: [1, 1, 1, 1], one state captured for an fc of four
@example(drawn=(_dspark(5, dspark_target_layer_ids=[1, 9, 17]), 36))  # fc sized 5 from the layers, trained on 3
@example(drawn=(_dspark(3, dspark_target_layer_ids=[1, 9, 40], num_target_layers=36), 36))  # 40: matches no layer
@example(drawn=(_dspark(5, dspark_target_layer_ids=[1, 9, 17, 25, 33], markov_rank=0), 36))  # no Markov head
def test_sglang_dspark_start_up_is_sglangs_own(release, drawn):
    check(release, *drawn, dspark=True)


@pytest.mark.parametrize("release", ["0.5.11", "0.5.17", "0.5.18", "0.5.23"])
@settings(max_examples=80, deadline=None)
@given(drawn=drafts(dspark=False))
def test_sglang_dflash_start_up_is_sglangs_own(release, drawn):
    check(release, *drawn, dspark=False)


@settings(max_examples=80, deadline=None)
@given(drawn=drafts(dspark=True), release=st.sampled_from(["0.5.16", "0.5.23"]), data=st.data())
@example(drawn=(_dspark(5, dspark_target_layer_ids=[1, 9, 17]), 36), release="0.5.16", data=None)
def test_every_dspark_finding_names_a_fix_that_clears(drawn, release, data):
    """Where the trained layers are known, each finding's fix is replayed and clears; the written config (the ids at
    every key read, the target's layer count) checks clean."""
    raw, L = drawn
    for place in (raw, raw["dflash_config"], raw.get("dspark_config", {})):  # a Markov head SGLang takes
        place.pop("markov_rank", None), place.pop("dspark_markov_rank", None)
    raw.update(markov_rank=1, markov_head_type="vanilla")
    taps_count = read_block_draft(raw, "t").taps
    if taps_count > L - 1:
        return  # more layers than the target has
    trained = list(range(1, 1 + taps_count)) if data is None else \
        sorted(data.draw(st.sets(st.integers(0, L - 2), min_size=taps_count, max_size=taps_count)))
    server = f"sglang@{release}"
    c = check_draft(raw, "t", [server], L, "qwen3", d.out_of(trained), "drawn", HIDDEN)
    for f in c.findings:
        assert "fix replayed:" in f.fix and not f.fix.startswith("no fix"), f
    fixed = fixed_config(raw, trained, L)
    assert not check_draft(fixed, "t", [server], L, "qwen3", d.out_of(trained), "drawn", HIDDEN).findings


def test_the_loops_read_test_each_layer_once_in_order():
    """d.LOOP's claim, in each model file of d.LOOP_TYPES and each release: the loop runs over the layers and tests
    membership, so states come in layer order, each once, none for the index past the last layer."""
    from sglang_src import body
    for release in ("0.5.11", *d.SGLANG_READ):
        forwards = [body(release, "python/sglang/srt/models/qwen2.py", "Qwen2Model.forward"),
                    body(release, "python/sglang/srt/models/llama.py", "LlamaModel.forward"),
                    body(release, "python/sglang/srt/models/qwen3.py", "Qwen3Model.forward")
                    or body(release, "python/sglang/srt/models/qwen2.py", "Qwen2Model.forward")]
        if None in forwards:
            pytest.skip(f"no unpacked sglang {release}")
        qwen3 = body(release, "python/sglang/srt/models/qwen3.py", "Qwen3Model")
        assert qwen3.startswith("class Qwen3Model(Qwen2Model)"), release
        for text in forwards:
            assert "for i in range(self.start_layer, self.end_layer):" in text, release
            assert "if i in self.layers_to_capture" in text, release
