"""The Triton block-FP8 kernels (tpsim.layers.triton_fp8) against their references, on drawn shapes:
the activation quantization bit for bit, the grouped GEMM (empty experts, uneven groups, a K that
ends inside a block) against the block-wise sum in float64, gate/up with silu * up and its
quantization fused in against the unfused reference, the whole FP8 MoE block against the
per-expert reference path, and its forward free of host syncs. GPU only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from test_fp8 import blockwise_reference
from tpsim.layers import fp8
from tpsim.layers.fp8 import BlockFp8, act_quant, quantize
from tpsim.layers.fused import silu_mul

triton_fp8 = pytest.importorskip("tpsim.layers.triton_fp8", reason="needs Triton")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run pytest -m gpu on a GPU node")]
ROOT = Path(__file__).resolve().parents[1]
BF16_BOUND = 2 ** -7  # a bf16 output against the float64 sum: its rounding, 2^-8 of the norm, twice
H_BOUND = 2 ** -5  # h quantized to e4m3 (3 mantissa bits): a bf16 ulp of difference can move an element a step


def stack(E: int, rows: int, cols: int, g: torch.Generator) -> BlockFp8:
    parts = [quantize(torch.randn(rows, cols, generator=g) * 0.05, (128, 128)) for _ in range(E)]
    return BlockFp8(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]), (128, 128))


def cuda(w: BlockFp8) -> BlockFp8:
    return BlockFp8(w.q.cuda(), w.scale_inv.cuda(), w.block)


def routed(counts: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ends `[E]` int32, src `[N]`: a token for each row, grouped by expert) for these rows per expert."""
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    src = torch.randint(0, max(1, sum(counts)), (sum(counts),), generator=g)
    return ends, src


@settings(max_examples=25, deadline=None)
@example(T=1, K=128, spread=1.0, seed=126)
@given(T=st.integers(1, 300), K=st.integers(1, 700), spread=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2 ** 16))
def test_act_quant_is_the_reference_bit_for_bit(T, K, spread, seed):
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * spread).to(torch.bfloat16).cuda()
    q, s = triton_fp8.act_quant(x, 128)
    rq, rs = act_quant(x, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


counts = st.lists(st.integers(0, 70), min_size=1, max_size=9)


def test_fits_refuses_rows_tma_cannot_read():
    """K = 28 fp8 bytes a row: TMA wants 16-byte rows (Hypothesis found the kernel wrong there: 1.5 of
    the norm off at rows=[1], K=28); such a weight stays on the reference."""
    assert not triton_fp8.fits(torch.empty(1, 28), torch.empty(1, 128, 28))
    assert fp8._fast(torch.empty(1, 28, dtype=torch.bfloat16, device="cuda"),
                     BlockFp8(torch.empty(128, 28, dtype=torch.float8_e4m3fn, device="cuda"),
                              torch.empty(1, 1, device="cuda"), (128, 128))) is None


@settings(max_examples=25, deadline=None)
@example(rows=[0, 5, 0, 131], nb=2, kb=3, tail=0, seed=0)
@example(rows=[1], nb=1, kb=1, tail=0, seed=0)
@given(rows=counts, nb=st.integers(1, 4), kb=st.integers(1, 4), tail=st.sampled_from([0, 16, 112]),
       seed=st.integers(0, 2 ** 16))
def test_grouped_gemm_is_each_groups_blockwise_sum(rows, nb, kb, tail, seed):
    """Group e's rows times w[e]^T, every group in one launch, against the block-wise float64 sum (K
    a multiple of 16, as `fits` asks: TMA reads 16-byte rows)."""
    g = torch.Generator().manual_seed(seed)
    K = kb * 128 - tail
    w = stack(len(rows), nb * 128, K, g)
    assert triton_fp8.fits(torch.empty(1, K), w.q)
    x = torch.randn(sum(rows), K, generator=g).to(torch.bfloat16)
    ends, _ = routed(rows, g)
    xq, xs = act_quant(x.cuda(), 128)
    y = triton_fp8.grouped_mm(xq, xs, w.q.cuda(), w.scale_inv.cuda(), ends.cuda(), torch.bfloat16).double().cpu()
    starts = [0] + ends.tolist()[:-1]
    ref = torch.cat([blockwise_reference(x[a:b].float(), w[e]) for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    if ref.numel():
        assert float((y - ref).norm() / ref.norm().clamp_min(1e-30)) <= BF16_BOUND


@settings(max_examples=25, deadline=None)
@example(T=2048, rows=576, K=1024, seed=0)  # DeepSeek-V3's kv_a_proj: 576 rows, cuBLAS's block-wise GEMM refuses it
@given(T=st.integers(1, 300), rows=st.integers(1, 5).map(lambda b: 128 * b) | st.sampled_from([64, 576, 200]),
       K=st.sampled_from([16, 128, 512, 640]), seed=st.integers(0, 2 ** 16))
def test_dense_gemm_is_the_blockwise_sum(T, rows, K, seed):
    """One weight, every row (the dense projections' launch: no groups read), a row count that ends inside a
    block too, against the block-wise float64 sum; `linear` takes it where torch._scaled_mm cannot."""
    g = torch.Generator().manual_seed(seed)
    w = BlockFp8(*quantize(torch.randn(rows, K, generator=g) * 0.05, (128, 128)), (128, 128))
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    y = triton_fp8.mm(*act_quant(x.cuda(), 128), w.q.cuda(), w.scale_inv.cuda(), torch.bfloat16).double().cpu()
    ref = blockwise_reference(x.float(), w)
    assert float((y - ref).norm() / ref.norm()) <= BF16_BOUND
    assert float((fp8.linear(x.cuda(), cuda(w)).double().cpu() - ref).norm() / ref.norm()) <= BF16_BOUND


@settings(max_examples=20, deadline=None)
@example(rows=[0, 3, 0, 200], ib=2, seed=0)
@given(rows=counts, ib=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_gate_up_fuses_silu_and_the_quantization(rows, ib, seed):
    """Rows gathered from the tokens, gate | up, silu(gate) * up quantized in the epilogue: its scales
    within bf16 rounding of the unfused reference's, the quantized h within H_BOUND of it."""
    g = torch.Generator().manual_seed(seed)
    H, I = 256, ib * 128
    w13 = cuda(stack(len(rows), 2 * I, H, g))
    ends, src = routed(rows, g)
    x = torch.randn(max(1, sum(rows)), H, generator=g).to(torch.bfloat16).cuda()
    src, ends = src.cuda(), ends.cuda()
    hq, hs = triton_fp8.expert_gate_up(*triton_fp8.act_quant(x, 128), src, w13.q, w13.scale_inv, ends)
    h = silu_mul(fp8.grouped_mm(*act_quant(x[src], 128), w13, ends, torch.bfloat16))
    rq, rs = act_quant(h, 128)
    if not h.numel():
        return
    assert float(((hs - rs).abs() / rs).max()) <= 2 ** -6
    got, want = hq.float() * hs.repeat_interleave(128, 1), rq.float() * rs.repeat_interleave(128, 1)
    assert float((got - want).norm() / want.norm().clamp_min(1e-30)) <= H_BOUND


def fp8_v3(layers: int, experts: int):
    from tpsim.config.loader import load_config, with_overrides
    cfg = with_overrides(load_config(ROOT / "configs/deepseek-v3.yaml"),
                         [f"num_hidden_layers={layers}", f"n_routed_experts={experts}", "n_group=4", "topk_group=2",
                          "first_k_dense_replace=1"])
    return dataclasses.replace(cfg, fp8_block=cfg.weight_block())


@pytest.fixture(scope="module")
def v3_fp8_model():
    from tpsim.parallel import TPGroup
    from tpsim.run.jobs import build_model
    return build_model(fp8_v3(2, 32), TPGroup(device=torch.device("cuda")), 0, "bfloat16")


@pytest.mark.parametrize("T", [1, 7, 300])
def test_fp8_moe_block_is_the_per_expert_reference(v3_fp8_model, T, monkeypatch):
    """The MoE block on the grouped kernels against the same block on one reference GEMM per expert."""
    moe = v3_fp8_model.model.layers[1].mlp
    x = (torch.randn(T, moe.experts.hidden, generator=torch.Generator().manual_seed(T)) * 0.5).to(torch.bfloat16).cuda()
    fast = moe(x).float()
    monkeypatch.setattr(fp8, "_fast", lambda *a: None)
    ref = moe(x).float()
    assert float((fast - ref).norm() / ref.norm()) <= H_BOUND


def test_fp8_forward_makes_no_host_sync(v3_fp8_model):
    from test_gpu import forward_without_host_sync
    capture, logits = forward_without_host_sync(v3_fp8_model, list(range(1, 600)))
    assert torch.isfinite(capture).all() and torch.isfinite(logits).all()
