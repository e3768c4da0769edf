"""Probe: GQA attention at Llama-3.1-8B's shapes (32 query heads, 8 KV heads, head_dim 128), one sequence:
K/V repeated per query head then SDPA, against SDPA's own enable_gqa, and the backend each picks. Medians of
CUDA-event timings; prints one line per variant."""
import torch
import torch.nn.functional as F

from cuda_timing import timed  # benchmarks/probes/, the script's folder

for T in (4096, 8192):
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
    def rep():
        kk, vv = (t.repeat_interleave(4, dim=1) for t in (k, v))
        qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, kk, vv))
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    def gqa():
        qq, kk, vv = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    ref = rep()
    try:
        got = gqa()
        err = float((got.float() - ref.float()).abs().max())
        print(f"T={T}: repeat+sdpa {timed(rep):.3f} ms, enable_gqa {timed(gqa):.3f} ms, max diff {err:.2e}")
    except Exception as e:
        print(f"T={T}: repeat+sdpa {timed(rep):.3f} ms, enable_gqa failed: {e}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        gqa(); torch.cuda.synchronize()
    print("  enable_gqa kernels:", sorted({e.name[:60] for e in p.events() if e.device_type.name == "CUDA"}))
