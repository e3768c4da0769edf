"""The block-FP8 GEMMs one at a time at DeepSeek-V3's shapes on one GPU (TP=1): each of a layer's
dense projections on the Triton kernel and on torch._scaled_mm (both with the activation's
quantization, Triton's), against the bf16 GEMM of the same shape; the routed experts' gate/up (with
silu * up and, in FP8, its quantization) and down projections, FP8 Triton against bf16
(torch._grouped_mm, tpsim's bf16 Triton gate/up). With --sweep, each Triton GEMM over a grid of
tiles first; the table then quotes the best tile and the default's. Each figure is the median over
--repeats of the call's kernel time on the GPU (torch.profiler; the host's launch time is left out: in a
forward the host runs ahead).

    python benchmarks/fp8_kernels.py --tokens 2048 --sweep
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpsim.base import ui  # noqa: E402
from tpsim.base.atomic import write_json  # noqa: E402
from tpsim.layers import triton_fp8 as tf  # noqa: E402
from tpsim.layers.fp8 import FP8, BlockFp8, _scaled_mm_fits, quantized_mm  # noqa: E402
from tpsim.layers.fused import expert_gate_up as bf16_gate_up  # noqa: E402
from tpsim.layers.triton_kernels import expert_gate_up as bf16_triton_gate_up  # noqa: E402

# (name, out, in) of one V3 layer's dense projections at TP=1
DENSE = (("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj", 576, 7168), ("kv_b_proj", 32768, 512),
         ("o_proj", 7168, 16384), ("mlp gate_up", 36864, 7168), ("mlp down", 7168, 18432),
         ("shared gate_up", 4096, 7168), ("shared down", 7168, 2048))
SWEEP = [tf.Tile(bm, group, warps, stages) for bm, group, (warps, stages) in
         itertools.product((32, 64, 128), (1, 8), ((4, 3), (4, 4), (8, 3), (8, 4)))]
SWEPT_DENSE = ("o_proj", "mlp gate_up")  # the dense shapes the sweep covers (the others take its best)


def timed(fn, repeats: int) -> float:
    """Median ms of `fn()`'s kernels (their time on the GPU, as in a forward where the host runs ahead; the
    host's launch time is not in it), over `repeats` calls each profiled alone, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        times.append(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3)
    return statistics.median(times)


def fp8_weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = (torch.randn(*shape, device="cuda") * 0.05).to(FP8)
    s = torch.rand(*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128), device="cuda") * 1e-3
    return q, s


def best_tile(run, repeats: int, sweep: bool, default: tf.Tile) -> tuple[tf.Tile, float, float]:
    """(the fastest tile, its ms, the default tile's ms) of `run(tile)`; tiles that fail to compile
    (shared memory) are passed over."""
    base = timed(lambda: run(default), repeats)
    best, best_ms = default, base
    for t in (SWEEP if sweep else []):
        try:
            ms = timed(lambda: run(t), repeats)
        except Exception as e:  # out of shared memory or registers at this tile
            ui.say(f"  tile {t}: {type(e).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = t, ms
    return best, best_ms, base


def dense_rows(T: int, repeats: int, sweep: bool) -> list[dict]:
    rows = []
    for name, N, K in DENSE:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        wq, ws = fp8_weight(1, N, K)
        w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)

        def triton_gemm(tile):
            xq, xs = tf.act_quant(x, 128)
            tf.launch(xq, xs, None, wq, ws, None, out, out, N, gate_up=False, tile=tile)

        tile, ms, default_ms = best_tile(triton_gemm, repeats, sweep and name in SWEPT_DENSE, tf.tile_for(T, 1, False))
        w = BlockFp8(wq[0], ws[0], (128, 128))
        scaled = (timed(lambda: quantized_mm(*tf.act_quant(x, 128), w, torch.bfloat16), repeats)
                  if _scaled_mm_fits(x, w) else None)
        rows.append({"gemm": name, "out": N, "in": K, "bf16_ms": timed(lambda: F.linear(x, w16), repeats),
                     "scaled_mm_ms": scaled, "triton_ms": ms, "triton_default_ms": default_ms, "tile": vars(tile)})
        ui.say(f"{name}: {rows[-1]}")
    return rows


def routing(T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, ends) of T tokens each sent to k distinct experts drawn uniformly."""
    ids = torch.rand(T, E, device="cuda").topk(k, dim=-1).indices.flatten()
    order = ids.argsort(stable=True)
    ends = torch.searchsorted(ids[order], torch.arange(E, device="cuda"), right=True).to(torch.int32)
    return torch.arange(T, device="cuda").repeat_interleave(k)[order], ends


def expert_rows(T: int, repeats: int, sweep: bool, E: int = 256, k: int = 8, H: int = 7168, I: int = 2048) -> list[dict]:
    src, ends = routing(T, E, k)
    N = src.shape[0]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w13q, w13s = fp8_weight(E, 2 * I, H)
    w2q, w2s = fp8_weight(E, H, I)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
    xq, xs = tf.act_quant(x, 128)
    hq, hs = tf.expert_gate_up(xq, xs, src, w13q, w13s, ends)
    h16 = torch.randn(N, I, device="cuda", dtype=torch.bfloat16)
    hq_out = torch.empty(N, I, device="cuda", dtype=FP8)
    hs_out = torch.empty(N, I // 128, device="cuda")
    y = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)
    gate_up, gu_ms, gu_default = best_tile(
        lambda t: tf.launch(xq, xs, src, w13q, w13s, ends, hq_out, hs_out, I, gate_up=True, tile=t),
        repeats, sweep, tf.tile_for(N, E, True))
    down, dn_ms, dn_default = best_tile(
        lambda t: tf.launch(hq, hs, None, w2q, w2s, ends, y, y, H, gate_up=False, tile=t),
        repeats, sweep, tf.tile_for(N, E, False))
    return [
        {"gemm": "experts gate_up", "rows": N, "experts": E, "triton_ms": gu_ms, "triton_default_ms": gu_default,
         "tile": vars(gate_up), "quant_ms": timed(lambda: tf.act_quant(x, 128), repeats),
         "bf16_grouped_ms": timed(lambda: bf16_gate_up(x, src, w13, ends), repeats),
         "bf16_triton_ms": timed(lambda: bf16_triton_gate_up(x, src, w13, ends), repeats)},
        {"gemm": "experts down", "rows": N, "experts": E, "triton_ms": dn_ms, "triton_default_ms": dn_default,
         "tile": vars(down),
         "bf16_grouped_ms": timed(lambda: torch._grouped_mm(h16, w2.transpose(-2, -1), offs=ends), repeats)},
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time every tile of the grid, quote the best")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8-kernels-cuda.json"))
    args = ap.parse_args(argv)
    experts = expert_rows(args.tokens, args.repeats, args.sweep)
    dense = dense_rows(args.tokens, args.repeats, args.sweep)

    def ms(v):
        return "-" if v is None else f"{v:.3f}"
    ui.titled_table(f"DeepSeek-V3 GEMMs at {args.tokens} tokens, one {torch.cuda.get_device_name()} (ms, median)",
                    ["gemm", "bf16", "fp8 _scaled_mm", "fp8 triton", "triton default tile", "tile"],
                    [[r["gemm"], ms(r.get("bf16_ms", r.get("bf16_grouped_ms"))), ms(r.get("scaled_mm_ms")),
                      ms(r["triton_ms"]), ms(r["triton_default_ms"]),
                      "{BM}x128 g{GROUP} w{num_warps} s{num_stages}".format(**r["tile"])] for r in experts + dense])
    write_json(Path(args.out), {
        "benchmark": "fp8_kernels", "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
        "settings": {"tokens": args.tokens, "repeats": args.repeats, "sweep": args.sweep},
        "experts": experts, "dense": dense})
    return 0


if __name__ == "__main__":
    sys.exit(main())
