"""Probe: the routed experts' gate/up kernel (tpsim.layers.triton_kernels.expert_gate_up) over tile settings, at
DeepSeek-V2-Lite's shapes (64 experts, top 6, hidden 2048, moe_intermediate 1408) and Qwen3-30B-A3B's (128, top 8,
2048, 768), 8192 tokens, uniform random routing, bf16, one GPU; against torch._grouped_mm + silu * up. Medians of
CUDA-event timings; one line per setting, and JSON to the path given (default: none)."""
import json
import sys

import torch

from cuda_timing import timed  # benchmarks/probes/, the script's folder
from tpsim.layers import fused, triton_kernels as tk

SHAPES = {"v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768)}
TILES = [dict(BM=128, BH=128, BK=64, GROUP=4, num_warps=8, num_stages=3),  # the current EXPERT_TILE
         dict(BM=128, BH=128, BK=64, GROUP=4, num_warps=8, num_stages=4),
         dict(BM=128, BH=128, BK=64, GROUP=8, num_warps=8, num_stages=3),
         dict(BM=128, BH=64, BK=64, GROUP=4, num_warps=4, num_stages=4),
         dict(BM=128, BH=64, BK=128, GROUP=4, num_warps=8, num_stages=3),
         dict(BM=64, BH=128, BK=64, GROUP=4, num_warps=4, num_stages=4),
         dict(BM=128, BH=128, BK=128, GROUP=4, num_warps=8, num_stages=2),
         dict(BM=256, BH=64, BK=64, GROUP=4, num_warps=8, num_stages=3)]


def main(out: str | None) -> None:
    torch.manual_seed(0)
    rows = []
    for name, (E, top, K, I) in SHAPES.items():
        T = 8192
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(E, 2 * I, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        experts = torch.rand(T, E, device="cuda").topk(top, dim=-1).indices.flatten()
        order, ends = fused.expert_order(experts, E)
        src = order // top
        flops = 2 * src.shape[0] * K * 2 * I
        ref = fused.expert_gate_up(x, src, w13, ends)
        ms = timed(lambda: fused.expert_gate_up(x, src, w13, ends))
        rows.append({"shape": name, "kernel": "grouped_mm + silu_mul", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{name}: grouped_mm + silu_mul {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for tile in TILES:
            tk.EXPERT_TILE.clear(); tk.EXPERT_TILE.update(tile)
            try:
                got = tk.expert_gate_up(x, src, w13, ends)
                err = float((got.float() - ref.float()).abs().max())
                ms = timed(lambda: tk.expert_gate_up(x, src, w13, ends))
                row = {"shape": name, "kernel": "triton", **tile, "ms": ms, "tflops": flops / ms / 1e9, "max_diff": err}
            except Exception as e:  # a tile past the shared memory or registers
                row = {"shape": name, "kernel": "triton", **tile, "error": str(e).splitlines()[0][:120]}
            rows.append(row)
            print(row, flush=True)
    if out:
        json.dump({"probe": "expert_gate_up_tiles", "gpu": torch.cuda.get_device_name(), "rows": rows},
                  open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
