"""GPT-OSS building blocks (tpsim.layers.gptoss, tpsim.weights.mxfp4) against transformers 5.24:
the MoE block on real gloo ranks equals `GptOssMLP` at every TP degree (and under EP), sink
attention on each rank's heads equals `eager_attention_forward` with the sliding-window mask,
and the MXFP4 dequantizer equals `convert_moe_packed_tensors`, whole and sliced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from strategies import TP_DEGREES
from tpsim.weights.mxfp4 import Mxfp4Source, dequantize, quantize
from tpsim.layers.gptoss import GptOssExperts, GptOssMoE, GptOssMoEShape
from tpsim.parallel import TPGroup
from tpsim.run.jobs import rel_err
from tpsim.testing.jobs import gptoss_moe_job, layer_input, sink_attention_job
from tpsim.weights.seeded import init_tensor

PREFIX = "model.layers.0.mlp"


@st.composite
def moe_cases(draw):
    """A TP degree, a GPT-OSS MoE shape it splits (I a multiple of tp; E of tp under EP), a seed,
    T, and whether to run expert-parallel. A small swiglu_limit makes both clamps bite."""
    tp = draw(st.sampled_from(TP_DEGREES), label="tp")
    ep = draw(st.booleans(), label="ep")
    E = tp * draw(st.integers(1, 2)) if ep else draw(st.integers(2, 9), label="experts")
    shape = {"hidden_size": draw(st.sampled_from([8, 16, 24]), label="hidden"),
             "intermediate_size": tp * draw(st.sampled_from([1, 2, 4]), label="I per rank"),
             "num_local_experts": E, "num_experts_per_tok": draw(st.integers(1, min(4, E)), label="top_k"),
             "swiglu_limit": draw(st.sampled_from([7.0, 0.3]), label="limit")}
    return tp, shape, draw(st.integers(0, 2**31 - 1), label="seed"), draw(st.integers(1, 12), label="T"), ep


def full_weights(shape: dict, seed: int) -> dict[str, torch.Tensor]:
    layer = GptOssMoE(GptOssMoEShape(**shape), TPGroup(), PREFIX, torch.float32)
    return {s.name.removeprefix(f"{PREFIX}."): init_tensor(seed, s.name, s.shape)
            for m in layer.modules() if hasattr(m, "weight_specs") for s in m.weight_specs()}


def transformers_moe(shape: dict, seed: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' GptOssMLP on the same weights and input: (output `[T, hidden]`, expert ids `[T, k]`)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    cfg = GptOssConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                       num_local_experts=shape["num_local_experts"],
                       num_experts_per_tok=shape["num_experts_per_tok"], swiglu_limit=shape["swiglu_limit"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    cfg._experts_implementation = "eager"
    mlp = GptOssMLP(cfg).eval()
    mlp.load_state_dict(full_weights(shape, seed), strict=True)
    x = layer_input(seed, (T, shape["hidden_size"]), torch.float32)
    with torch.no_grad():
        out, _ = mlp(x[None])
        _, _, ids = mlp.router(x)
    return out[0], ids


@settings(max_examples=15, deadline=None)
@given(case=moe_cases())
@example(case=(8, {"hidden_size": 16, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "swiglu_limit": 7.0}, 3, 9, False))  # every rank a 2-wide slice of every expert
@example(case=(4, {"hidden_size": 8, "intermediate_size": 8, "num_local_experts": 8, "num_experts_per_tok": 4,
                   "swiglu_limit": 0.3}, 5, 3, True))  # EP with fewer tokens than ranks: empty shards
def test_gptoss_moe_equals_transformers_at_every_degree(rank_pool, case):
    tp, shape, seed, T, ep = case
    out = rank_pool.run(gptoss_moe_job, shape=shape, seed=seed, T=T, tp=tp, ep=ep)
    ranks = [out[r] for r in range(tp)]
    want, want_ids = transformers_moe(shape, seed, T)
    if ep:
        got = torch.cat([o["out"] for o in ranks])
        ids = torch.cat([o["ids"] for o in ranks])
    else:
        assert all(torch.equal(o["out"], ranks[0]["out"]) for o in ranks), "a Replicate() output differs between ranks"
        got, ids = ranks[0]["out"], ranks[0]["ids"]
    assert all(o["all_reduces"] == (1 if tp > 1 and not ep else 0) for o in ranks)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values), "routed to other experts than transformers"
    assert rel_err(got, want) <= 1e-5


@st.composite
def attention_cases(draw):
    """A TP degree, heads it splits (KV heads split or replicated as in test_gqa), T, a window
    (None, or 1..T+2: shorter than T, equal, longer) and a seed."""
    tp = draw(st.sampled_from(TP_DEGREES), label="tp")
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k % tp == 0 or tp % k == 0]), label="kv_heads")
    heads = max(kv, tp) * draw(st.sampled_from([1, 2]), label="group")
    T = draw(st.integers(1, 16), label="T")
    window = draw(st.one_of(st.none(), st.integers(1, T + 2)), label="window")
    return tp, heads, kv, draw(st.sampled_from([4, 8]), label="head_dim"), T, window, draw(
        st.integers(0, 2**31 - 1), label="seed")


def transformers_sink_attention(heads, kv, d, T, window, seed) -> torch.Tensor:
    """transformers' GPT-OSS eager_attention_forward, with its causal or sliding-window mask function."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    module = torch.nn.Module().eval()
    module.num_key_value_groups = heads // kv
    module.sinks = init_tensor(seed, "model.layers.0.self_attn.sinks", (heads,))
    q = layer_input(seed, (T, heads, d), torch.float32)
    k, v = (layer_input(seed + i, (T, kv, d), torch.float32) for i in (1, 2))
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    seen = fn(zero, zero, torch.arange(T)[:, None], torch.arange(T)[None, :])
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, _ = eager_attention_forward(module, *(t.transpose(0, 1)[None] for t in (q, k, v)), mask, scaling=d ** -0.5)
    return out[0]  # [T, heads, d]


@settings(max_examples=15, deadline=None)
@given(case=attention_cases())
@example(case=(8, 16, 2, 4, 12, 5, 7))  # window shorter than T, each KV head on four ranks
@example(case=(2, 4, 4, 8, 9, None, 1))
def test_sink_attention_equals_transformers_eager_on_each_ranks_heads(rank_pool, case):
    tp, heads, kv, d, T, window, seed = case
    out = rank_pool.run(sink_attention_job, heads=heads, kv_heads=kv, head_dim=d, T=T, window=window, seed=seed, tp=tp)
    sinks = init_tensor(seed, "model.layers.0.self_attn.sinks", (heads,))
    assert torch.equal(torch.cat([out[r]["sinks"] for r in range(tp)]), sinks), "a rank holds other heads' sinks"
    got = torch.cat([out[r]["out"] for r in range(tp)], dim=1)
    assert rel_err(got, transformers_sink_attention(heads, kv, d, T, window, seed)) <= 1e-5


@st.composite
def packed(draw):
    """Random MXFP4 blocks `[E, rows, G, 16]` and scales `[E, rows, G]` (E8M0 bytes 0..254)."""
    E, rows, G = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    lo, hi = draw(st.sampled_from([(0, 255), (110, 140)]), label="scale range")
    return (torch.randint(0, 256, (E, rows, G, 16), generator=g, dtype=torch.uint8),
            torch.randint(lo, hi, (E, rows, G), generator=g, dtype=torch.uint8))


def _index(draw, n: int):
    if draw(st.booleans()):
        return draw(st.integers(-n, n - 1))
    a = draw(st.integers(0, n))
    return slice(a, draw(st.integers(a, n)))


@settings(max_examples=15, deadline=None)
@given(data=packed(), pick=st.data())
def test_mxfp4_dequantizes_as_transformers_whole_and_sliced(data, pick):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    blocks, scales = data
    full = dequantize(blocks, scales)
    torch.testing.assert_close(full, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
                               rtol=0, atol=0, equal_nan=True)
    src = Mxfp4Source(blocks, scales)
    assert src.shape == tuple(full.shape)
    idx = tuple(_index(pick.draw, n) for n in full.shape[:pick.draw(st.integers(1, 3), label="dims indexed")])
    torch.testing.assert_close(src[idx], full[idx], rtol=0, atol=0, equal_nan=True)


@settings(max_examples=15, deadline=None)
@given(data=packed())
def test_mxfp4_quantize_round_trips_values_on_the_grid(data):
    blocks, scales = data
    w = dequantize(blocks, scales.clamp(1, 250))  # finite: 6 * 2**(250 - 127) < float32's max
    b, s = quantize(w)
    assert torch.equal(dequantize(b, s), w)
    # off the grid: a group with scale 2**e (< its max / 3) is off by at most half the grid's widest step (2)
    x = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    assert (dequantize(*quantize(x)) - x).abs().max() <= x.abs().max() / 3


@settings(max_examples=10, deadline=None)
@given(tp=st.sampled_from(TP_DEGREES), per_rank=st.sampled_from([8, 16, 32, 48]), seed=st.integers(0, 2**31 - 1))
def test_experts_load_the_same_slice_from_mxfp4_as_from_the_dequantized_tensor(tp, per_rank, seed):
    """Each rank's expert slice read through Mxfp4Source equals the one cut from the whole
    dequantized tensor (the lazy reader picks the right blocks and nibbles), slices that cut a
    32-value group included."""
    E, H, I = 3, 64, tp * per_rank
    assume(I % 32 == 0)
    g = torch.Generator().manual_seed(seed)
    packs = {"gate_up_proj": (E, 2 * I, H // 32), "down_proj": (E, H, I // 32)}
    packs = {n: (torch.randint(0, 256, (*s, 16), generator=g, dtype=torch.uint8),
                 torch.randint(118, 130, s, generator=g, dtype=torch.uint8)) for n, s in packs.items()}
    for r in range(tp):
        loaded = []
        for lazy in (True, False):
            experts = GptOssExperts(H, I, 0, E, TPGroup(rank=r, size=tp, ranks=tuple(range(tp))), "experts",
                                    torch.float32, E)
            for spec in experts.weight_specs():
                name = spec.name.removeprefix("experts.")
                if name in packs:
                    src = Mxfp4Source(*packs[name]) if lazy else dequantize(*packs[name])
                    assert tuple(src.shape) == spec.shape
                else:
                    src = torch.zeros(spec.shape)
                spec.load(src)
            loaded.append((experts.w13.clone(), experts.w2.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*loaded)), r
        full = dequantize(*packs["gate_up_proj"])  # [E, H, 2I], gate at even columns
        n = per_rank
        assert torch.equal(loaded[0][0][:, :n], full[..., 0::2][..., r * n:(r + 1) * n].transpose(1, 2))
        assert torch.equal(loaded[0][0][:, n:], full[..., 1::2][..., r * n:(r + 1) * n].transpose(1, 2))


@st.composite
def prefill_cases(draw):
    """Query heads, KV heads dividing them, head_dim, T, a window (None: causal only), a seed."""
    kv = draw(st.sampled_from([1, 2, 4]), label="kv")
    heads = kv * draw(st.sampled_from([1, 2, 4]), label="group")
    T = draw(st.integers(1, 40), label="T")
    window = draw(st.one_of(st.none(), st.integers(1, T + 2)), label="window")
    return heads, kv, draw(st.sampled_from([16, 32]), label="head_dim"), T, window, draw(st.integers(0, 2 ** 16))


def prefill(heads, kv, d, T, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, d, generator=g).to(dtype).to(device) for h in (heads, kv, kv))
    return q, k, v, (torch.randn(heads, generator=g) * 2).to(device)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@settings(max_examples=25, deadline=None)
@given(case=prefill_cases())
@example(case=(4, 2, 16, 33, 5, 0))  # a window shorter than T, two query heads on each KV head
@example(case=(2, 2, 16, 1, None, 1))
def test_flex_attention_rescaled_by_its_lse_is_sink_attention(case):
    """Flex attention (eager here: the same masks, GQA and log-sum-exp the compiled kernel computes on CUDA)
    without sinks, times sigmoid(lse - sink), equals the reference that concatenates the sink as a logit."""
    from tpsim.layers.sinks import flex_sinks, sink_attention
    heads, kv, d, T, window, seed = case
    q, k, v, sinks = prefill(heads, kv, d, T, seed)
    assert rel_err(flex_sinks(q, k, v, sinks, window, None), sink_attention(q, k, v, sinks, window)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run pytest -m gpu on a GPU node")
@settings(max_examples=4, deadline=None)  # each shape compiles its kernel
@given(heads=st.sampled_from([8, 16]), kv=st.sampled_from([1, 2, 8]), d=st.sampled_from([64, 128]),
       blocks=st.integers(1, 3), window=st.sampled_from([None, 1, 7, 128]), seed=st.integers(0, 2 ** 16))
@example(heads=8, kv=2, d=64, blocks=2, window=7, seed=0)
def test_compiled_flex_sink_attention_is_the_reference_on_cuda(heads, kv, d, blocks, window, seed):
    """The compiled flex kernel (what GPT-OSS runs at speed) in bf16 against the float32-softmax reference,
    on the prefills it takes: within bf16 rounding of the inputs' products and of the output (2^-6 of the norm).
    T = 40 with d = 32 is left to the reference (inductor found no kernel for it)."""
    from tpsim.layers.sinks import flex_applies, sink_attention, sink_attention_flex
    q, k, v, sinks = prefill(heads, kv, d, 128 * blocks, seed, torch.bfloat16, "cuda")
    assert flex_applies(q, k, None) and not flex_applies(q[:40, :, :32], k[:40, :, :32], None)
    got, want = sink_attention_flex(q, k, v, sinks, window), sink_attention(q, k, v, sinks, window)
    assert rel_err(got.float().cpu(), want.float().cpu()) <= 2 ** -6
