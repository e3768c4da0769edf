"""The compiled memory-bound kernels (tpsim.layers.fused) against their eager reference, on CUDA
(`pytest -m gpu`; skipped elsewhere: torch.compile's CPU backend would build C++ for minutes on
the CI machine): each kernel on drawn shapes (float32 <= 1e-5, bf16 within 2^-7 of the norm), and a
whole model compiled against eager: the capture within the bf16 bound, no host sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tpsim.layers import fused

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run pytest -m gpu on a GPU node")]

BOUND = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def compiled():
    return fused.compiled_kernels()


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 700), width=st.sampled_from([64, 512, 2048]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 16))
def test_each_compiled_kernel_is_its_eager_reference(compiled, T, width, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r = (torch.randn(T, width, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    w = torch.rand(width, device="cuda", generator=g, dtype=dtype) + 0.5
    e = fused.EAGER
    k = torch.rand(T, 6, device="cuda", generator=g)
    y = torch.randn(T, 6, width, device="cuda", generator=g, dtype=dtype)
    assert rel(compiled.weighted_sum(k, y), e.weighted_sum(k, y)) <= BOUND[dtype]
    for got, want in zip(compiled.add_rms_norm(x, r, w, 1e-6), e.add_rms_norm(x, r, w, 1e-6)):
        assert rel(got, want) <= BOUND[dtype]
    assert rel(compiled.rms_norm(x, w, 1e-6), e.rms_norm(x, w, 1e-6)) <= BOUND[dtype]
    assert rel(compiled.silu_mul(x), e.silu_mul(x)) <= BOUND[dtype]
    q = x.view(T, width // 64, 64)
    ang = torch.rand(T, 1, 32, device="cuda", generator=g)
    assert rel(compiled.rope_pairs(q, ang.cos(), ang.sin()), e.rope_pairs(q, ang.cos(), ang.sin())) <= BOUND[dtype]


def test_a_compiled_forward_captures_what_the_eager_one_does_without_host_sync(compiled):
    from tpsim.capture import Recorder
    from tpsim.profiles.conventions import resolve
    from tpsim.config.loader import load_config, with_overrides
    from tpsim.run.jobs import build_model
    from tpsim.parallel import TPGroup
    cfg = with_overrides(load_config("configs/deepseek-v2-lite.yaml"), ["num_hidden_layers=3"])
    model = build_model(cfg, TPGroup(device=torch.device("cuda")), 0, "bfloat16")
    ids = torch.arange(1000, 1512, device="cuda")
    positions = resolve("sglang-ids", None, 3).positions[:2]
    caps = []
    for on in (False, True, True):  # eager, compiled (compiles), compiled again
        model.kernels = fused.KernelPolicy(on, min_tokens=1)
        r = Recorder(positions)
        with torch.inference_mode():
            if len(caps) == 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                model(ids, recorder=r)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        caps.append(r.concat())
    assert rel(caps[1], caps[0]) <= 3e-2 and torch.equal(caps[1], caps[2])
    from tpsim.layers.attention import MLA
    from tpsim.layers.moe import MoE
    assert {MLA._forward, MoE._forward} <= set(fused._regions)  # the compiled forward ran the regions


def _triton_kernels(compiled):
    if fused._triton is None:
        pytest.skip("Triton is not installed: the compiled regions fuse the reference forms")
    return fused._triton


@settings(max_examples=16, deadline=None)
@given(T=st.integers(1, 300), heads=st.sampled_from([1, 3, 16]), v=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_the_triton_q_k_assembly_is_its_reference(compiled, T, heads, v, dtype, seed):
    """MLA's q and k heads from one Triton pass: the copied parts (q's nope dims, k's nope dims and
    the shared k_pe) bitwise, the rotated rope dims within the kernels' bound, on strided views as
    the attention passes them (q a view of q_proj's output, k_pe of kv_a_proj's, kv of kv_b_proj's)."""
    tk = _triton_kernels(compiled)
    g = torch.Generator(device="cuda").manual_seed(seed)
    nope, rope = 128, 64
    q = torch.randn(T, heads * (nope + rope), device="cuda", generator=g, dtype=dtype).view(T, heads, nope + rope)
    k_pe = torch.randn(T, 512 + rope, device="cuda", generator=g, dtype=dtype)[:, 512:].view(T, 1, rope)
    kv = torch.randn(T, heads * (nope + v), device="cuda", generator=g, dtype=dtype).view(T, heads, nope + v)
    ang = torch.rand(T, 1, rope // 2, device="cuda", generator=g) * 1000
    assert tk.fits_rope_assemble(q, k_pe, kv)
    (q1, k1), (q0, k0) = (f(q, k_pe, kv, ang.cos(), ang.sin())
                          for f in (fused.rope_assemble_qk_fast, fused.rope_assemble_qk))
    assert torch.equal(q1[..., :nope], q0[..., :nope]) and torch.equal(k1, k0)
    assert rel(q1[..., nope:], q0[..., nope:]) <= BOUND[dtype]


@settings(max_examples=16, deadline=None)
@given(T=st.integers(1, 300), E=st.sampled_from([8, 64, 160]), k=st.sampled_from([1, 2, 6]),
       softmax=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_the_triton_greedy_router_is_its_reference(compiled, T, E, k, softmax, seed):
    """The router's pick from one Triton pass per token: the same experts in the same order wherever
    the reference's margin leaves room for the kernels' rounding, the same scores and margins in
    float32 to 1e-6 of the largest."""
    _triton_kernels(compiled)
    logits = torch.randn(T, E, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)) * 3
    (w1, i1, m1), (w0, i0, m0) = (f(logits, k, softmax) for f in (fused.greedy_top_fast, fused.greedy_top))
    clear = m0 > 1e-5
    assert torch.equal(i1[clear], i0[clear])
    assert ((w1 - w0).abs() * clear[:, None]).max().item() <= 1e-6
    assert torch.allclose(m1, m0, atol=1e-6, rtol=0)


def test_the_triton_kernels_leave_zero_tokens_to_the_reference(compiled):
    """An EP rank can route no tokens: no kernel is launched on an empty grid, and the shapes hold."""
    tk = _triton_kernels(compiled)
    q, k_pe, kv = (torch.empty(0, 16, d, device="cuda", dtype=torch.bfloat16) for d in (192, 64, 256))
    k_pe = k_pe[:, :1]
    assert not tk.fits_rope_assemble(q, k_pe, kv)
    cos = sin = torch.empty(0, 1, 32, device="cuda")
    assert [t.shape for t in fused.rope_assemble_qk_fast(q, k_pe, kv, cos, sin)] == [(0, 16, 192)] * 2
    w, i, m = fused.greedy_top_fast(torch.empty(0, 64, device="cuda"), 6, True)
    assert w.shape == i.shape == (0, 6) and m.shape == (0,)


@settings(max_examples=16, deadline=None)
@given(T=st.integers(1, 900), E=st.sampled_from([1, 8, 64]), k=st.sampled_from([1, 2, 6]),
       hidden=st.sampled_from([64, 256, 2048]), inter=st.sampled_from([88, 704, 1408]),
       idle=st.floats(0, 0.5), seed=st.integers(0, 2 ** 16))
def test_the_triton_expert_gate_up_is_its_reference(compiled, T, E, k, hidden, inter, idle, seed):
    """The routed experts' gather, gate/up GEMM and silu * up in one kernel, against the gather, the
    grouped GEMM and silu_mul: within the bf16 bound over drawn routings, some experts routed nothing,
    intermediate sizes that are not a multiple of the tile, rows read through a token index."""
    tk = _triton_kernels(compiled)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) / hidden ** 0.5
    p = torch.rand(E, device="cuda", generator=g) * (torch.rand(E, device="cuda", generator=g) >= idle) + 1e-9
    experts = torch.multinomial(p, T * k, replacement=True, generator=g)
    order, ends = fused.expert_order(experts, E)
    src = order // k  # row (token, slot) in expert order reads token's hidden
    fits = tk.fits_expert_gate_up(x, src, w13)
    assert fits == (T * k >= tk.MIN_ROWS_PER_EXPERT * E)
    got, want = fused.expert_gate_up_fast(x, src, w13, ends), fused.expert_gate_up(x, src, w13, ends)
    assert got.shape == want.shape == (T * k, inter)
    assert rel(got, want) <= BOUND[torch.bfloat16]
    traced = torch.compile(fused.expert_gate_up_fast, fullgraph=True, dynamic=False)(x, src, w13, ends)
    if fits:  # a region traces the op whole: the same kernel, the same bits
        assert torch.equal(traced, got)
    else:  # the reference, compiled: inductor rounds silu * up once where eager rounds twice
        assert rel(traced, want) <= BOUND[torch.bfloat16]


def test_the_triton_expert_gate_up_leaves_zero_rows_to_the_reference(compiled):
    tk = _triton_kernels(compiled)
    x, w13 = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16), torch.randn(8, 32, 64, device="cuda",
                                                                                    dtype=torch.bfloat16)
    src, ends = torch.empty(0, dtype=torch.long, device="cuda"), torch.zeros(8, dtype=torch.int32, device="cuda")
    assert not tk.fits_expert_gate_up(x, src, w13)
    assert fused.expert_gate_up_fast(x, src, w13, ends).shape == (0, 16)


@settings(max_examples=24, deadline=None)
@given(N=st.integers(1, 70_000), E=st.sampled_from([1, 3, 8, 64, 160, 256, 1024]), idle=st.floats(0, 0.9),
       seed=st.integers(0, 2 ** 16))
@example(N=48, E=64, idle=0.0, seed=0)  # the 8-token decode step of V2-Lite
@example(N=49_152, E=64, idle=0.0, seed=1)  # 8192 tokens, 6 experts each
def test_the_triton_expert_places_are_the_stable_sort(compiled, N, E, idle, seed):
    """The counting sort's order, expert ends and places equal the stable radix sort's, the binary
    search's and the inverse permutation's, bit for bit: drawn row counts across block boundaries,
    expert counts that are not powers of two, idle experts (a block, or the whole routing, without
    an expert); and the same traced whole, as a region runs it."""
    tk = _triton_kernels(compiled)
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.rand(E, device="cuda", generator=g) * (torch.rand(E, device="cuda", generator=g) >= idle) + 1e-9
    experts = torch.multinomial(p, N, replacement=True, generator=g)
    assert tk.fits_expert_places(experts, E) == (N <= tk.PLACES_BLOCKS * tk._places_tile(E)[1])
    want = fused.expert_places(experts, E)
    got = fused.expert_places_fast(experts, E)
    traced = torch.compile(fused.expert_places_fast, fullgraph=True, dynamic=False)(experts, E)
    for a, b, c in zip(got, want, traced):
        assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(c, b)
