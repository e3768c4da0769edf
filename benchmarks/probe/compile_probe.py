"""Probe (issue 17): V2-Lite's prefill on one GPU, eager against the compiled memory-bound kernels
(tpsim.layers.fused), and where the eager forward spends its time."""
import json, os, statistics, time
import torch
from tpsim.bench.hf import build_models
from tpsim.capture import Recorder, resolve
from tpsim.config import load_config
from tpsim.layers import fused
from tpsim.run.spec import input_ids_for
OUT = os.environ.get("OUT", ".")
cfg = load_config("configs/deepseek-v2-lite.yaml")
model, _ = build_models(cfg, 0, "bfloat16", torch.device("cuda"), transformers=False)
positions = resolve("sglang", None, cfg.num_hidden_layers).positions
res = {}
def timeit(ids, n=7):
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); model(ids); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)
def capture(ids):
    r = Recorder(positions)
    model(ids, recorder=r)
    return r.concat().float()
with torch.inference_mode():
    for T in (4096, 8192):
        ids = torch.tensor(input_ids_for(cfg, 0, T), device="cuda")
        fused.use_compiled(False); model(ids); torch.cuda.synchronize()
        res[f"eager_ms_{T}"] = timeit(ids); ref = capture(ids)
        fused.use_compiled(True)
        t0 = time.perf_counter(); model(ids); torch.cuda.synchronize(); res[f"compile_s_{T}"] = time.perf_counter() - t0
        res[f"compiled_ms_{T}"] = timeit(ids)
        got = capture(ids)
        res[f"capture_rel_{T}"] = float((got - ref).norm() / ref.norm())
        print(json.dumps(res), flush=True)
    fused.use_compiled(False)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(ids); torch.cuda.synchronize()
    open(os.path.join(OUT, "eager_profile.txt"), "w").write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
json.dump(res, open(os.path.join(OUT, "compile_probe.json"), "w"))
