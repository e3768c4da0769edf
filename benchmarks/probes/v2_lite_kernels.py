"""Probe: where DeepSeek-V2-Lite's 8192-token forward could still lose time, kernel by kernel, at its shapes
(hidden 2048, 16 heads, qk 192 / v 128, kv_lora 512, 64 experts top 6, moe_intermediate 1408, 2 shared experts,
vocab 102400), bf16, one GPU, uniform random routing. Medians of CUDA-event timings.

- routed gate/up: the current kernel (tokens gathered inside it), a gathered copy then a TMA-fed variant of it
  (with and without Triton's warp specialization), torch._grouped_mm + silu * up, and one dense GEMM of the same
  rows (the ceiling a grouping cannot beat);
- routed down: torch._grouped_mm, a TMA-fed Triton grouped GEMM, the dense GEMM;
- the dense projections one by one, and q_proj with kv_a_proj_with_mqa as one GEMM;
- the causal attention at 8192 tokens under each SDPA backend that takes it.

One line per measurement, and JSON to the path given (default: none). First run on an H100 on 2026-12-07, on
8074ee1's tree (benchmarks/results/probe-v2-lite-kernels-h100.json): the gathered, TMA-fed gate/up won (1.13 against
1.42 ms); grouped_mm kept the down projection (0.49 ms; the TMA variants 0.73-0.80). The library kernel fed that
way, with this tile mapping shared, is on branch i54-tma-gate-up, untested on a GPU (docs/benchmarks.md).

    cd benchmarks/probes && PYTHONPATH=../.. python3 v2_lite_kernels.py OUT.json"""
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cuda_timing import timed  # benchmarks/probes/, the script's folder
from tpsim.layers import fused, triton_kernels as tk

T, HID, E, TOP, I = 8192, 2048, 64, 6, 1408
BM, BN, BK, GROUP = 128, 128, 64, 4


@triton.jit
def _grouped_tma(a_ptr, w_ptr, ends_ptr, tile_ends_ptr, out_ptr, N, K, NOUT, NT, PROGRAMS,
                 E: tl.constexpr, BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP: tl.constexpr, GATE_UP: tl.constexpr, WS: tl.constexpr):
    """Rows already in expert order (TMA loads of A); GATE_UP: w holds [gate | up] per expert (NOUT = I each)
    and silu(gate) * up is written, else w is [E * NOUT, K] and the product is written."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[N, K], strides=[K, 1], block_shape=[BM, BK])
    W_ROWS: tl.constexpr = 2 if GATE_UP else 1
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[E * W_ROWS * NOUT, K], strides=[K, 1], block_shape=[BN, BK])
    ei = tl.arange(0, BE)
    tile_ends = tl.load(tile_ends_ptr + ei, mask=ei < E, other=2 ** 30)
    m_tiles = tl.load(tile_ends_ptr + E - 1)
    for tile in range(tl.program_id(0), m_tiles * NT, PROGRAMS):
        first = tile // (GROUP * NT) * GROUP
        size = tl.minimum(m_tiles - first, GROUP)
        tm, tn = first + (tile - first * NT) % size, (tile - first * NT) // size
        e = tl.sum((tile_ends <= tm).to(tl.int32))
        prev = tl.maximum(e - 1, 0)
        first_row, first_tile = tl.load(ends_ptr + prev), tl.load(tile_ends_ptr + prev)
        m0 = tl.where(e > 0, first_row, 0) + (tm - tl.where(e > 0, first_tile, 0)) * BM
        rows = m0 + tl.arange(0, BM)
        wrow = e * W_ROWS * NOUT + tn * BN
        g = tl.zeros((BM, BN), tl.float32)
        if GATE_UP:
            u = tl.zeros((BM, BN), tl.float32)
            for k in tl.range(0, K, BK, warp_specialize=WS):
                ak = a_desc.load([m0, k])
                g = tl.dot(ak, w_desc.load([wrow, k]).T, g)
                u = tl.dot(ak, w_desc.load([wrow + NOUT, k]).T, u)
            g = g.to(tl.bfloat16).to(tl.float32)
            u = u.to(tl.bfloat16).to(tl.float32)
            res = g * tl.sigmoid(g) * u
        else:
            for k in tl.range(0, K, BK, warp_specialize=WS):
                g = tl.dot(a_desc.load([m0, k]), w_desc.load([wrow, k]).T, g)
            res = g
        cols = tn * BN + tl.arange(0, BN)
        keep = (rows < tl.load(ends_ptr + e))[:, None] & (cols < NOUT)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * NOUT + cols[None, :], res.to(tl.bfloat16), mask=keep)


def grouped_tma(a, w, ends, gate_up: bool, ws: bool, stages: int = 3):
    N, K = a.shape
    nout = w.shape[1] // (2 if gate_up else 1)
    tiles = (torch.diff(ends, prepend=ends.new_zeros(1)) + BM - 1) // BM
    tile_ends = torch.cumsum(tiles, 0).to(torch.int32)
    out = a.new_empty((N, nout))
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count
    _grouped_tma[(programs,)](a, w, ends, tile_ends, out, N, K, nout, triton.cdiv(nout, BN), programs,
                              E=w.shape[0], BE=triton.next_power_of_2(w.shape[0]), BM=BM, BN=BN, BK=BK, GROUP=GROUP,
                              GATE_UP=gate_up, WS=ws, num_warps=8, num_stages=stages)
    return out


def row(rows, name, ms, flops, **extra):
    r = {"kernel": name, "ms": ms, "tflops": flops / ms / 1e9, **extra}
    rows.append(r)
    print(f"{name:44s} {ms:8.3f} ms {r['tflops']:6.0f} TFLOP/s {extra or ''}", flush=True)


def attempt(rows, name, flops, fn, ref=None):
    try:
        got = fn()
        err = {} if ref is None else {"max_diff": float((got.float() - ref.float()).abs().max())}
        row(rows, name, timed(fn), flops, **err)
    except Exception as e:  # a variant this Triton or this GPU does not take
        rows.append({"kernel": name, "error": str(e).splitlines()[0][:160]})
        print(name, "error:", rows[-1]["error"], flush=True)


def experts(rows):
    x = torch.randn(T, HID, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * I, HID, device="cuda", dtype=torch.bfloat16) * HID ** -0.5
    w2 = torch.randn(E, HID, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    ids = torch.rand(T, E, device="cuda").topk(TOP, dim=-1).indices.flatten()
    order, ends = fused.expert_order(ids, E)
    src = order // TOP
    N = src.shape[0]
    up_flops, down_flops = 2 * N * HID * 2 * I, 2 * N * I * HID
    ref = fused.expert_gate_up(x, src, w13, ends)
    xs = x[src]
    row(rows, "gather x[src]", timed(lambda: x[src]), 0)
    attempt(rows, "gate/up: current (gathered inside)", up_flops, lambda: tk.expert_gate_up(x, src, w13, ends), ref)
    attempt(rows, "gate/up: grouped_mm + silu_mul", up_flops, lambda: fused.expert_gate_up(x, src, w13, ends), ref)
    for ws in (False, True):
        for stages in (3, 4):
            attempt(rows, f"gate/up: TMA ws={ws} stages={stages} (no gather)", up_flops,
                    lambda: grouped_tma(xs, w13.view(E, 2 * I, HID), ends, True, ws, stages), ref)
    attempt(rows, "gate/up: gather + TMA ws=False", up_flops,
            lambda: grouped_tma(x[src], w13, ends, True, False), ref)
    dense = torch.randn(2 * I, HID, device="cuda", dtype=torch.bfloat16)
    attempt(rows, "gate/up: dense GEMM, same rows (ceiling)", up_flops, lambda: F.linear(xs, dense))
    h = ref
    down_ref = torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends)
    attempt(rows, "down: grouped_mm (current)", down_flops,
            lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends), down_ref)
    for ws in (False, True):
        for stages in (3, 4):
            attempt(rows, f"down: TMA ws={ws} stages={stages}", down_flops,
                    lambda: grouped_tma(h, w2, ends, False, ws, stages), down_ref)
    dense2 = torch.randn(HID, I, device="cuda", dtype=torch.bfloat16)
    attempt(rows, "down: dense GEMM, same rows (ceiling)", down_flops, lambda: F.linear(h, dense2))


PROJECTIONS = {"q_proj": (HID, 16 * 192), "kv_a_proj_with_mqa": (HID, 576), "q_proj + kv_a (one GEMM)": (HID, 3648),
               "kv_b_proj": (512, 16 * 256), "o_proj": (16 * 128, HID), "shared gate/up": (HID, 2 * 2 * I),
               "shared down": (2 * I, HID), "router (fp32 out)": (HID, E), "lm_head": (HID, 102400),
               "dense layer gate/up": (HID, 2 * 10944), "dense layer down": (10944, HID)}


def projections(rows):
    for name, (k, n) in PROJECTIONS.items():
        x = torch.randn(T, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        fn = (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)) if "router" in name else (lambda: F.linear(x, w))
        attempt(rows, name, 2 * T * k * n, fn)


def attention(rows):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 16, T, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 16, T, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 16, T, 128, device="cuda", dtype=torch.bfloat16)
    flops = T * T * 16 * (192 + 128)  # causal: T^2/2 pairs, 2 flops a multiply-add
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
        attempt(rows, f"attention: {backend.name}", flops, run)
    vp = F.pad(v, (0, 64))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        attempt(rows, "attention: FLASH, v padded to 192", flops,
                lambda: F.scaled_dot_product_attention(q, k, vp, is_causal=True, scale=0.1))


def main(out: str | None) -> None:
    torch.manual_seed(0)
    rows = []
    print("triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    experts(rows)
    projections(rows)
    attention(rows)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    row(rows, "mm 8192^3 (the run's ceiling)", timed(lambda: a @ a), 2 * 8192 ** 3)
    if out:
        json.dump({"probe": "v2_lite_kernels", "gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
