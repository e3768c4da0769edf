"""Probe (one-off): does this torch's _scaled_mm take DeepSeek-style block scales on this GPU?"""
import torch, time, os, json, inspect
out = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
M, K, N = 256, 512, 384
x = torch.randn(M, K, device="cuda")
w = torch.randn(N, K, device="cuda")
xq = x.to(torch.float8_e4m3fn); wq = w.to(torch.float8_e4m3fn)
sx = torch.rand(M, K // 128, device="cuda") + 0.5
sw = torch.rand(N // 128, K // 128, device="cuda") + 0.5
ref = (xq.float() * sx.repeat_interleave(128, 1)) @ (wq.float() * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
tries = {}
def attempt(name, fn):
    try:
        y = fn()
        tries[name] = {"ok": True, "rel": float((y.float() - ref).norm() / ref.norm())}
    except Exception as e:
        tries[name] = {"ok": False, "err": f"{type(e).__name__}: {str(e)[:300]}"}
attempt("scaled_mm_blockwise_colmajor_scale_a", lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx.t().contiguous().t(), scale_b=sw.t(), out_dtype=torch.bfloat16))
attempt("scaled_mm_blockwise_plain", lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=torch.bfloat16))
try:
    import torch.nn.functional as F
    out["has_F_scaled_mm"] = hasattr(F, "scaled_mm")
    if hasattr(F, "scaled_mm"):
        out["F_scaled_mm_sig"] = str(inspect.signature(F.scaled_mm))
        from torch.nn.functional import ScalingType, SwizzleType
        out["ScalingType"] = [s.name for s in ScalingType]
        attempt("F.scaled_mm blockwise", lambda: F.scaled_mm(xq, wq.t(), sx.t().contiguous().t(), ScalingType.BlockWise1x128, sw.t(), ScalingType.BlockWise128x128, output_dtype=torch.bfloat16))
except Exception as e:
    out["F_err"] = repr(e)[:300]
try:
    import triton; out["triton"] = triton.__version__
except Exception as e:
    out["triton_err"] = repr(e)
out["tries"] = tries
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
