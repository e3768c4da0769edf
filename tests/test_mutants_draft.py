"""Issue 55 deliver 5, the mutation round on tpsim/draft/: bugs planted one at a time that the tests covering draft/
let through, each killed here (its docstring names it; each was checked by planting it: the test fails with it, and
passes without). The properties hold over drawn inputs: which tensor a loader reads, the row count of fc, the id
count at the bound, which layout key wins, the draft layer's input order and its residual."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from test_draft_checkpoint import CONFIG, clean_tensors
from tpsim.base.errors import UsageError
from tpsim.draft.attention import DraftCache
from tpsim.draft.checkpoint import DraftCheckpoint, inspect, runnable
from tpsim.draft.config import MAX_IDS, DraftConfig, check_id_count, check_keys, flat
from tpsim.draft.findings import DraftDefect
from tpsim.draft.layer import DraftLayer
from tpsim.draft.tensors import merge
from tpsim.parallel.group import TPGroup

CFG = DraftConfig.from_json(CONFIG)  # hidden 16, three captures of 16


def checkpoint(tensors: dict[str, torch.Tensor], cfg: DraftConfig = CFG, conflicts=None) -> DraftCheckpoint:
    return DraftCheckpoint(Path("draft"), cfg, tensors, conflicts=conflicts or {})


def found(ckpt: DraftCheckpoint, target_hidden: int | None = None) -> set[tuple[DraftDefect, str]]:
    return {(f.defect, f.key) for f in inspect(ckpt, target_hidden)}


# --- draft/checkpoint.py --------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), seed=st.integers(0, 3))
@example(rows=CFG.hidden_size - 1, seed=0)
def test_fc_is_misshapen_when_its_rows_are_not_the_hidden_size(rows, seed):
    """Planted bug: fc.weight's row count never compared with hidden_size (`_misshapen` returned False for fc, its
    width being `_fc_width`'s finding). fc writes the draft's hidden state: rows other than hidden_size are a
    shape finding (and a refusal before any rank: the draft's load raised a ValueError traceback)."""
    t = clean_tensors(CFG, seed)
    t["fc.weight"] = torch.zeros(rows, CFG.capture_width)
    bad = (DraftDefect.SHAPE, "fc.weight") in found(checkpoint(t))
    assert bad is (rows != CFG.hidden_size)
    if bad:
        with pytest.raises(UsageError, match=r"shape \(fc.weight\)"):
            _runnable(checkpoint(t))


def _runnable(ckpt: DraftCheckpoint) -> DraftCheckpoint:
    import tpsim.draft.checkpoint as module
    with pytest.MonkeyPatch.context() as m:
        m.setattr(module, "read", lambda path, needs="": ckpt)
        return runnable(ckpt.path, "")


@settings(max_examples=30, deadline=None)
@given(declared=st.integers(1, 64), target=st.integers(1, 64), hidden=st.sampled_from([16, 32]))
@example(declared=48, target=48, hidden=16)  # a draft narrower than its target, declared right
def test_a_config_alone_is_judged_by_the_target_hidden_size_it_declares(declared, target, hidden):
    """Planted bug: the config-alone fc-width check compared the draft's hidden_size (not its target_hidden_size)
    with the target's. A config alone declares fc as num_aux x target_hidden_size: fc-width iff that is not the
    target's hidden size, whatever the draft's own width."""
    raw = {**CONFIG, "hidden_size": hidden, "head_dim": hidden // 4, "target_hidden_size": declared}
    ckpt = DraftCheckpoint(Path("draft"), DraftConfig.from_json(raw), {}, raw=raw, weights=False)
    assert ((DraftDefect.FC_WIDTH, "target_hidden_size") in found(ckpt, target)) is (declared != target)


UNREAD = st.sampled_from(["embed_tokens.bias", "midlayer.extra.weight", "model.layers.0.mlp.weight", "lm_head.bias",
                          "mtp.0.weight"])


@settings(max_examples=25, deadline=None)
@given(name=UNREAD, kind=st.sampled_from(["nan", "inf", "int", "bool", "conflict"]), seed=st.integers(0, 3))
@example(name="midlayer.extra.weight", kind="nan", seed=0)
@example(name="lm_head.bias", kind="conflict", seed=0)
def test_a_tensor_no_loader_reads_is_ignored_whatever_it_holds(name, kind, seed):
    """Planted bugs: the dtype and non-finite checks run over every tensor of the checkpoint, not those the draft
    reads; and a conflict between shards reported for a tensor no loader reads. A tensor the draft has no place for
    is skipped by every loader (its ignored-key finding says so): what it holds (NaN, Inf, an integer or boolean
    dtype, two different copies) changes nothing the draft computes, so it is no other finding and no refusal."""
    clean = clean_tensors(CFG, seed)
    value = {"nan": torch.full((4,), float("nan")), "inf": torch.full((4,), float("inf")),
             "int": torch.arange(4), "bool": torch.ones(4, dtype=torch.bool), "conflict": torch.ones(4)}[kind]
    tensors, where, conflicts = {}, {}, {}
    merge(tensors, where, conflicts, {**clean, name: value}, "a.safetensors")
    if kind == "conflict":
        merge(tensors, where, conflicts, {name: value * 2}, "b.safetensors")
    ckpt = checkpoint(tensors, conflicts=conflicts)
    assert found(ckpt) == {(DraftDefect.IGNORED_KEY, name)}
    assert _runnable(ckpt) is ckpt


# --- draft/config.py ------------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 2 * MAX_IDS))
@example(n=MAX_IDS)
@example(n=MAX_IDS + 1)
def test_the_id_bound_admits_exactly_max_ids(n):
    """Planted bugs: the id-count bound and the num_aux_hidden_states bound off by one (`>=` MAX_IDS refused a
    config of exactly MAX_IDS, which the message calls allowed: "at most 256"). Both admit 1..MAX_IDS."""
    for check in (lambda: check_id_count([1] * n), lambda: check_keys({"num_aux_hidden_states": n}, "c")):
        try:
            check()
        except UsageError as e:
            assert n > MAX_IDS, (n, e)
            continue
        assert n <= MAX_IDS


SPECULATORS = {"speculators_model_type": "eagle3", "speculators_config": {"algorithm": "eagle3"}}


@settings(max_examples=25, deadline=None)
@given(key=st.sampled_from(["draft_vocab_size", "target_hidden_size", "vocab_size", "hidden_size"]),
       own=st.integers(1, 10**4), layer=st.integers(1, 10**4))
def test_a_speculators_drafts_own_key_wins_over_its_layer_config(key, own, layer):
    """Planted bug: a key written both at the top of a speculators config and inside transformer_layer_config read
    from the layer config. speculators' Eagle3SpeculatorConfig keeps the draft's own keys at the top; the layer's
    are its Llama layer's: the top-level value is the draft's."""
    raw = {**SPECULATORS, key: own, "transformer_layer_config": {key: layer, "num_attention_heads": 4}}
    assert flat(raw)[key] == own


@settings(max_examples=25, deadline=None)
@given(theta=st.floats(1.0, 1e7), nested=st.floats(1.0, 1e7))
@example(theta=500000.0, nested=10000.0)
def test_rope_parameters_fill_in_rope_theta_only_where_it_is_absent(theta, nested):
    """Planted bug: rope_parameters.rope_theta replaced a rope_theta the layer config writes. The nested value is
    read only where the layer gives no rope_theta of its own (transformers' newer layout); one written wins."""
    layer = {"rope_parameters": {"rope_theta": nested, "rope_type": "default"}}
    assert flat({**SPECULATORS, "transformer_layer_config": {**layer, "rope_theta": theta}})["rope_theta"] == theta
    assert flat({**SPECULATORS, "transformer_layer_config": layer})["rope_theta"] == nested


# --- draft/layer.py -------------------------------------------------------------------------------------------

def _layer(seed: int, **flags) -> DraftLayer:
    g = torch.Generator().manual_seed(seed)
    layer = DraftLayer(dataclasses.replace(CFG, **flags), TPGroup(device=torch.device("cpu")), "midlayer",
                       torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4 + (1.0 if p.dim() == 1 else 0.0))
    return layer


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_the_draft_layer_reads_the_embedding_first(seed):
    """Planted bug: the midlayer's attention input concatenated as [hidden, embedding] (SpecForge, EAGLE, SGLang
    and vLLM concatenate the normed embedding first: qkv_proj's first hidden_size input columns are the token's).
    With those columns zeroed, the layer's output cannot depend on the tokens; the hidden state still matters."""
    layer, H = _layer(seed), CFG.hidden_size
    with torch.no_grad():
        layer.self_attn.qkv_proj.weight[:, :H] = 0
        g = torch.Generator().manual_seed(seed + 1)
        hidden, embeds, pos = torch.randn(3, H, generator=g), torch.randn(2, 3, H, generator=g), torch.arange(3)
        outs = [layer(pos, e, hidden, DraftCache()) for e in embeds]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
        assert not torch.allclose(layer(pos, embeds[0], hidden * 2, DraftCache()), outs[0], atol=1e-3)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), before=st.booleans())
def test_norm_before_residual_makes_the_residual_the_normed_hidden(seed, before):
    """Planted bug: `norm_before_residual` ignored (the residual always the raw hidden state). vLLM llama_eagle3
    (`_norm_before_residual`): the residual is hidden_norm(hidden) when set, else the hidden. With attention and
    MLP writing nothing (o_proj, down_proj zero), the layer's output is exactly that residual."""
    layer = _layer(seed, norm_before_residual=before)
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        g = torch.Generator().manual_seed(seed + 1)
        hidden = torch.randn(4, CFG.hidden_size, generator=g) * 3
        out = layer(torch.arange(4), torch.randn(4, CFG.hidden_size, generator=g), hidden, DraftCache())
        torch.testing.assert_close(out, layer.hidden_norm(hidden) if before else hidden, atol=1e-5, rtol=1e-5)
