"""Benchmark helpers and jobs (jobs run on every rank through a RankPool or torchrun, like tpsim.run.jobs).

- `overhead_job`: capture vs no capture per TP degree (benchmarks/capture_overhead.py);
- `build_models`: tpsim at TP=1 and transformers' DeepseekV2/V3ForCausalLM with the same seeded
  weights, built in memory (benchmarks/forward.py, tests/test_bench.py);
- `active_params`, `forward_flops`, `tp_all_reduces`: the FLOP and collective formulas;
- `forward_sweep_job`: seconds per forward (and in its all-reduces) per token count at a TP degree;
  `tp_table` runs it for every TP degree in one pool (benchmarks/forward_tp.py, forward.py's CPU table);
- `allreduce_job`: the all-reduce sweep (benchmarks/allreduce.py);
- `cuda_capture_job`: a capture on CUDA ranks with TF32 off (tests/test_gpu.py).
"""

from __future__ import annotations

import re
import statistics
import time

import torch
import torch.distributed as dist

from tpsim.capture import Position, Recorder
from tpsim.config import config_from_dict
from tpsim.run.jobs import build_model, input_ids_for
from tpsim.parallel.launch import RankContext


def timed_forward(model, ids: torch.Tensor, positions: list[Position] | None = None) -> tuple[float, list]:
    """(seconds, collective records) of one full forward (logits included) of this rank's model,
    with EAGLE-3 capture of `positions` (a fresh Recorder, timed up to and including its
    `concat()`) or without (None). The TP group meets at a barrier first so all ranks start
    together; the clock (time.perf_counter, after a CUDA synchronize) covers only the forward."""
    group = model.group
    if group.size > 1:
        dist.barrier(group=group.pg)
    group.tracer.clear()
    cuda = group.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(group.device)
    t0 = time.perf_counter()
    recorder = Recorder(positions) if positions is not None else None
    model(ids, recorder=recorder, logits=True)
    if recorder is not None:
        recorder.concat()
    if cuda:
        torch.cuda.synchronize(group.device)
    return time.perf_counter() - t0, list(group.tracer.records)


def overhead_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, seq_len: int, positions: list[str],
                 tp: int, warmup: int, repeats: int) -> dict | None:
    """Wall time of one full forward (logits included) on this rank at TP=`tp`, with EAGLE-3
    capture of `positions` (a fresh Recorder per forward, timed up to and including its
    `concat()`) and without (recorder=None).

    The two variants are interleaved in ABBA order so slow drift (thermal, other load) hits
    both equally. Before every timed forward the TP group meets at a barrier so all ranks start
    together; the clock (time.perf_counter) covers only the forward. Also returns the
    all-reduces of one captured forward (count and bytes of this rank's input), and whether a
    plain forward runs exactly the same collectives. None on ranks outside the first TP block.
    """
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    pos = [Position.parse(p, config.num_hidden_layers) for p in positions]
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype)
    ids = torch.tensor(input_ids_for(config, seed, seq_len), dtype=torch.long, device=group.device)

    def timed(capture: bool) -> tuple[float, list]:
        return timed_forward(model, ids, pos if capture else None)

    ctx.progress(f"TP={tp}: {warmup} warmup + {repeats} timed pairs, seq_len {seq_len}")
    for _ in range(warmup):
        timed(True)
        timed(False)
    with_capture, without = [], []
    for i in range(repeats):
        for capture in ((True, False) if i % 2 == 0 else (False, True)):
            seconds, records = timed(capture)
            (with_capture if capture else without).append(seconds)
            if capture:
                cap_records = records
            else:
                plain_records = records
    if repeats == 0:
        _, cap_records = timed(True)
        _, plain_records = timed(False)
    key = [(r.op, r.caller, r.bytes) for r in cap_records]
    return {
        "rank": ctx.rank, "tp": tp, "group_rank": group.rank,
        "with_capture_s": with_capture, "without_capture_s": without,
        "all_reduces": sum(r.op == "all_reduce" for r in cap_records),
        "all_reduce_bytes": sum(r.bytes for r in cap_records if r.op == "all_reduce"),
        "collectives": len(cap_records),
        "same_collectives": key == [(r.op, r.caller, r.bytes) for r in plain_records],
    }


# --- shared by benchmarks/forward.py, benchmarks/allreduce.py and the tests --------------------------------------

def write_json_atomic(path, data: dict) -> None:
    """Write `data` as JSON to `path` through a temporary file in the same directory and a rename:
    a killed run leaves the previous file untouched, never a half-written one."""
    import json
    import os
    import tempfile
    from pathlib import Path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def strict_fp32() -> None:
    """No TF32 anywhere in this process (matmul and cuDNN): float32 comparisons on CUDA need it.
    PyTorch's default already leaves matmul TF32 off; this makes it explicit and covers cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# --- seeded weights for tpsim and transformers at once -----------------------------------------------------------

def seeded_tensors(seed: int, device: torch.device):
    """`fn(name, shape)` -> the full float32 tensor tpsim seeds for that checkpoint name, on `device`:
    `init_tensor(..., device=)` where its signature has it (generated on the device), else
    generated on the CPU and moved."""
    import inspect

    from tpsim.weights import init_tensor
    if "device" in inspect.signature(init_tensor).parameters:
        return lambda name, shape: init_tensor(seed, name, shape, device=device)
    return lambda name, shape: init_tensor(seed, name, shape).to(device)


def hf_config_for(cfg):
    """The transformers DeepseekV2Config / DeepseekV3Config of a tpsim config (same fields)."""
    import transformers
    v3 = cfg.model_type == "deepseek_v3"
    cls = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    drop = {"model_type", "quantization_config", "architectures", "torch_dtype", "dtype", "tpsim"}
    if v3:  # transformers' V3 has only noaux_tc / sigmoid and takes neither field
        drop |= {"topk_method", "scoring_func"}
    return cls(**{k: v for k, v in cfg.to_dict().items() if k not in drop})


def hf_unsupported(cfg) -> str | None:
    """Why transformers cannot hold this config's tpsim weights (None when it can)."""
    if cfg.model_type == "deepseek_v2" and cfg.moe_layer_freq != 1 and cfg.n_routed_experts:
        return ("transformers' DeepseekV2 makes every layer >= first_k_dense_replace an MoE layer "
                f"(moe_layer_freq={cfg.moe_layer_freq} is ignored), so it cannot hold tpsim's weights; "
                "use --skip-transformers")
    return None


def build_hf_model(cfg, dtype: str, device: torch.device, attn_implementation: str = "sdpa",
                   experts_implementation: str | None = None):
    """transformers' DeepseekV2ForCausalLM (V3 for a V3 config) built in memory on `device` in
    `dtype` (router weights stay float32, as transformers keeps them), weights not yet filled."""
    import transformers

    from tpsim.errors import UsageError
    from tpsim.run.jobs import DTYPES
    why = hf_unsupported(cfg)
    if why:
        raise UsageError(why)
    cls = transformers.DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else transformers.DeepseekV2ForCausalLM
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device(device):
        model = cls._from_config(hf_config_for(cfg), **kwargs)
    return model.eval()


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class HFWeights:
    """Copies tpsim checkpoint tensors (HF names) into a transformers model, whatever layout its
    experts have: per-expert modules (checkpoint names), or transformers 5's fused
    `experts.gate_up_proj` `[E, 2I, H]` / `experts.down_proj` `[E, H, I]` (or their transposes,
    `is_transposed`; gate/up interleaved instead of concatenated, `is_concatenated=False`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors = dict(model.named_parameters())
        self.tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
        self.filled: dict[str, int] = {}  # name -> elements written

    def _mark(self, name: str, n: int) -> None:
        self.filled[name] = self.filled.get(name, 0) + n

    def load(self, name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if name in self.tensors:
                dst = self.tensors[name]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"transformers' {name} is {list(dst.shape)}, tpsim's {list(t.shape)}")
                dst.copy_(t)
                self._mark(name, t.numel())
                return
            m = _EXPERT.match(name)
            if m is None:
                raise KeyError(f"transformers' model has no tensor for checkpoint name {name}")
            prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
            experts = self.model.get_submodule(prefix)
            transposed = getattr(experts, "is_transposed", False)
            if proj == "down_proj":
                key = f"{prefix}.down_proj"
                dst = self.tensors[key][e]
                dst.copy_(t.T if transposed else t)
            else:
                key = f"{prefix}.gate_up_proj"
                fused = self.tensors[key][e]
                if transposed:
                    fused = fused.T  # now [2I, H] like the untransposed layout
                inter = fused.shape[0] // 2
                if getattr(experts, "is_concatenated", True):
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                else:
                    rows = slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2)
                dst = fused[rows]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"transformers' {key}[{e}] {proj} part is {list(dst.shape)}, tpsim's "
                                     f"{name} is {list(t.shape)}")
                dst.copy_(t)
            self._mark(key, t.numel())

    def check_complete(self) -> None:
        """Every parameter (and correction-bias buffer) of the transformers model was written in
        full; a tied lm_head is the embedding's parameter and counts once."""
        missing = [n for n, p in self.tensors.items() if self.filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"tpsim's checkpoint tensors did not fill transformers' {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")


def build_models(cfg, seed: int, dtype: str, device: torch.device, transformers: bool = True,
                 attn_implementation: str = "sdpa", experts_implementation: str | None = None, progress=None):
    """tpsim at TP=1 (a `TPGroup(device=...)`, no process group) and, with `transformers`,
    transformers' model, both holding the same seeded weights: each checkpoint tensor is
    generated once (`seeded_tensors`), cast to the dtype tpsim keeps it in, and copied into both.
    Returns (tpsim model, transformers model or None)."""
    import time as _time

    from tpsim.checkpoint.export import tensor_dtype
    from tpsim.run.jobs import DTYPES
    from tpsim.model import DeepseekForCausalLM
    from tpsim.parallel.group import TPGroup
    from tpsim.weights import weight_specs
    device = torch.device(device)
    model = DeepseekForCausalLM(cfg, TPGroup(device=device), DTYPES[dtype])
    hf = hf_weights = None
    if transformers:
        if progress:
            progress("building transformers' model")
        hf = build_hf_model(cfg, dtype, device, attn_implementation, experts_implementation)
        hf_weights = HFWeights(hf)
    make = seeded_tensors(seed, device)
    specs = list(weight_specs(model))
    last = _time.monotonic()
    for i, spec in enumerate(specs):
        t = make(spec.name, spec.shape)
        spec.load(t)
        if hf_weights is not None:
            hf_weights.load(spec.name, t.to(tensor_dtype(spec.name, DTYPES[dtype])))
        del t
        if progress and _time.monotonic() - last > 5:
            progress(f"seeding weights: {i + 1}/{len(specs)} tensors")
            last = _time.monotonic()
    if hf_weights is not None:
        hf_weights.check_complete()
    return model, hf


# --- FLOPs and collectives by formula -----------------------------------------------------------------------------

def active_params(cfg) -> dict:
    """Matmul weights one token multiplies through in a forward (embedding lookup excluded,
    lm_head included; MoE layers: router + shared experts + top_k routed experts; MLA:
    q_proj (or q_a_proj + q_b_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj). Norm weights,
    the e_score_correction_bias and RoPE are not matmuls and are not counted."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    qk, nope, v = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = H * heads * qk
    else:
        q = H * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
    attn = q + H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (nope + v) + heads * v * H
    dense = 3 * H * cfg.intermediate_size
    L, n_moe = cfg.num_hidden_layers, cfg.moe_layer_count()
    moe = 0
    if n_moe:
        moe = (H * cfg.n_routed_experts + 3 * H * cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
               + 3 * H * cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    lm_head = H * cfg.vocab_size
    total = L * attn + (L - n_moe) * dense + n_moe * moe + lm_head
    return {"attention_per_layer": attn, "dense_mlp_per_layer": dense, "moe_per_layer": moe,
            "dense_layers": L - n_moe, "moe_layers": n_moe, "lm_head": lm_head, "total": total}


FLOP_FORMULA = ("flops(T) = 2*T*P_active + L*T^2*heads*(qk_head_dim + v_head_dim); P_active = matmul weights per "
                "token (embedding lookup excluded, lm_head over vocab_size included; MoE: router + shared + top_k "
                "routed experts; MLA: q_proj or q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj); attention: causal "
                "prefill of T tokens counted as T^2/2 query-key pairs, 2 flops per multiply-add, for QK^T "
                "(qk_head_dim) and PV (v_head_dim) in each of L layers; norms, RoPE, softmax, activations, routing "
                "and the final logits slice not counted")


def forward_flops(cfg, T: int) -> dict:
    """FLOPs of one forward of one sequence of T tokens (FLOP_FORMULA)."""
    p = active_params(cfg)
    dense = 2 * T * p["total"]
    attention = cfg.num_hidden_layers * T * T * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return {"matmul": dense, "attention": attention, "total": dense + attention}


def tp_all_reduces(cfg, T: int, dtype: str, tp: int) -> dict:
    """All-reduces of one forward at TP=tp by formula: pure TP runs 1 (embedding) + 2 per layer
    (o_proj, MLP/MoE), each of this rank's `[T, hidden]` activation in `dtype` (what `tpsim
    check` counts from the collective trace at TP > 1); none at TP=1. The lm_head's all-gather of
    logits is not an all-reduce and is not counted here."""
    from tpsim.run.jobs import DTYPES
    n = 0 if tp == 1 else 1 + 2 * cfg.num_hidden_layers
    return {"tp": tp, "all_reduces": n, "bytes": n * T * cfg.hidden_size * DTYPES[dtype].itemsize}


# --- jobs ----------------------------------------------------------------------------------------------------------

def forward_sweep_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, tokens: list[int], tp: int, warmup: int,
                      repeats: int, time_all_reduces: bool = False) -> dict | None:
    """Seconds of one plain forward (logits included, no capture) on this rank at TP=`tp` for
    each token count, one model for all of them; the TP group meets at a barrier before every
    timed forward. Also the all-reduces (count, bytes of this rank's input) of one forward per
    token count and, with `time_all_reduces`, the seconds this rank waited for them in each timed
    forward (`Tracer.timed`). None on ranks outside the first TP block."""
    if not ctx.participates(tp):
        return None
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    group.tracer.timed = time_all_reduces  # the group outlives this job: switched off again below
    try:
        model = build_model(config, group, seed, dtype)
        rows = []
        for T in tokens:
            ids = torch.tensor(input_ids_for(config, seed, T), dtype=torch.long, device=group.device)
            ctx.progress(f"TP={tp}: {T} tokens, {warmup} warmup + {repeats} timed forwards")
            for _ in range(warmup):
                timed_forward(model, ids)
            seconds, ar_seconds, records = [], [], list(group.tracer.records)
            for _ in range(repeats):
                t, records = timed_forward(model, ids)
                seconds.append(t)
                ar_seconds.append(sum(r.seconds() or 0.0 for r in records if r.op == "all_reduce"))
            rows.append({"tokens": T, "seconds": seconds, "all_reduce_seconds": ar_seconds,
                         "all_reduces": sum(r.op == "all_reduce" for r in records),
                         "all_reduce_bytes": sum(r.bytes for r in records if r.op == "all_reduce"),
                         "collectives": len(records)})
    finally:
        group.tracer.timed = False
    return {"rank": ctx.rank, "tp": tp, "group_rank": group.rank, "rows": rows}


def tp_table(cfg, tps: list[int], tokens: list[int], dtype: str, seed: int, warmup: int, repeats: int, progress,
             device: str = "cpu", timeout_s: float = 300.0) -> dict:
    """Seconds per plain forward at each TP degree, over one self-spawned pool of max(tps) ranks:
    NCCL with one GPU per rank on CUDA (a degree needing more GPUs than there are is skipped with
    the reason, as is one the config cannot split), gloo on the CPU. Per iteration the slowest
    rank counts, then the median; all-reduces counted and timed from the trace
    (`forward_sweep_job`), their time per forward the mean over ranks, then the median."""
    from tpsim.errors import UsageError
    from tpsim.parallel.launch import RankPool, default_backend
    backend = default_backend(device)
    gpus = torch.cuda.device_count() if device == "cuda" else None
    ok, skipped = [], []
    for tp in tps:
        try:
            cfg.check_tp(tp)
            if gpus is not None and tp > gpus:
                raise UsageError(f"TP={tp} over NCCL needs {tp} GPUs; this machine has {gpus}")
            ok.append(tp)
        except UsageError as e:
            skipped.append({"tp": tp, "reason": str(e)})
    if not ok:
        raise UsageError("no TP degree to run: " + "; ".join(s["reason"] for s in skipped))
    rows, t0 = [], time.perf_counter()
    # verify_collectives off: its extra all-gather per collective would be timed too
    with RankPool(world=max(ok), backend=backend, device=device, timeout_s=timeout_s, on_progress=progress,
                  env={"TPSIM_VERIFY_COLLECTIVES": "0"}) as pool:
        for tp in ok:
            res = pool.run(forward_sweep_job, cfg=cfg.to_dict(), seed=seed, dtype=dtype, tokens=tokens,
                           tp=tp, warmup=warmup, repeats=repeats, time_all_reduces=True)
            ranks = [r for r in res.values() if r is not None]
            assert len(ranks) == tp, f"TP={tp}: {len(ranks)} ranks answered"
            for i, T in enumerate(tokens):
                per_rank = [r["rows"][i] for r in ranks]
                slowest = [max(pr["seconds"][j] for pr in per_rank) for j in range(repeats)]
                ar = [statistics.mean(pr["all_reduce_seconds"][j] for pr in per_rank) for j in range(repeats)]
                first, formula = per_rank[0], tp_all_reduces(cfg, T, dtype, tp)
                row = {"tp": tp, "tokens": T, "median_s": statistics.median(slowest), "min_s": min(slowest),
                       "max_s": max(slowest), "slowest_rank_s": slowest, "all_reduces": first["all_reduces"],
                       "all_reduce_bytes": first["all_reduce_bytes"], "all_reduces_formula": formula["all_reduces"],
                       "all_reduce_bytes_formula": formula["bytes"], "all_reduce_s": statistics.median(ar)}
                row["tokens_per_s"] = T / row["median_s"]
                row["all_reduce_busbw_gbps"] = (2 * (tp - 1) / tp * row["all_reduce_bytes"] / row["all_reduce_s"] / 1e9
                                                if row["all_reduce_s"] > 0 else None)
                rows.append(row)
    for r in rows:
        smallest = next(x for x in rows if x["tp"] == r["tp"])
        base = next((x for x in rows if x["tp"] == 1 and x["tokens"] == r["tokens"]), None)
        r["growth_vs_smallest"] = r["median_s"] / smallest["median_s"]
        r["speedup"] = None if base is None else base["median_s"] / r["median_s"]
        r["efficiency"] = None if base is None else r["speedup"] / r["tp"]
    return {"tps": ok, "skipped": skipped, "tokens": tokens, "dtype": dtype, "backend": backend, "warmup": warmup,
            "repeats": repeats, "torch_threads_per_rank": 1, "wall_s": time.perf_counter() - t0,
            "note": "per iteration the slowest rank's seconds (a TP forward ends when its last rank does), then the "
                    "median" + ("" if device == "cuda" else "; all ranks share this machine's cores, so TP > 1 rows "
                                "say nothing about GPU scaling"),
            "rows": rows}


def allreduce_job(ctx: RankContext, sizes: list[int], dtype: str, warmup: int, iters: int,
                  inner: int | None = None) -> dict:
    """A plain all-reduce sweep over the whole world (torch.distributed directly, no tracer).

    Per size: a check that the sum is right (rank r contributes r + 1 everywhere), then
    `warmup` untimed and `iters` timed samples on a zero-filled buffer. A sample starts after a
    barrier and times `inner` back-to-back all-reduces (CUDA events on a GPU, perf_counter on the
    CPU); its value is that time / inner. `inner` defaults to 64 MiB / size, clamped to 1..50, so
    a small all-reduce is not lost in the timer's resolution. Returns this rank's samples."""
    from tpsim.run.jobs import DTYPES
    dev, world = ctx.device, ctx.world_size
    cuda = dev.type == "cuda"
    dt = DTYPES[dtype]

    def barrier():
        if ctx.backend == "nccl":
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    rows = []
    for size in sizes:
        n = max(1, size // dt.itemsize)
        reps = inner or max(1, min(50, (64 << 20) // max(size, 1)))
        ctx.progress(f"all-reduce {size:,} bytes: check, {warmup} warmup + {iters} samples x {reps}")
        x = torch.full((n,), float(ctx.rank + 1), dtype=dt, device=dev)
        dist.all_reduce(x)
        correct = bool((x == world * (world + 1) / 2).all())
        x.zero_()
        samples = []
        for i in range(warmup + iters):
            barrier()
            if cuda:
                torch.cuda.synchronize(dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    dist.all_reduce(x)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    dist.all_reduce(x)
                seconds = time.perf_counter() - t0
            if i >= warmup:
                samples.append(seconds / reps)
        rows.append({"bytes": n * dt.itemsize, "elements": n, "inner": reps, "correct": correct,
                     "seconds": samples})
        del x
    return {"rank": ctx.rank, "world": world, "device": str(dev), "backend": ctx.backend, "rows": rows}


def cuda_capture_job(ctx: RankContext, cfg: dict, seed: int, dtype: str, input_ids: list[int], positions: list[str],
                     tp: int) -> dict | None:
    """tests/test_gpu.py: this rank's capture (moved to the CPU: CUDA tensors do not travel through
    the pool's queue), the device it ran on, its all-reduces and MoE routing, with TF32 off in
    this rank process (float32 comparisons across TP degrees need IEEE float32)."""
    if not ctx.participates(tp):
        return None
    from tpsim.run.jobs import run_captured
    strict_fp32()
    config = config_from_dict(cfg)
    group = ctx.groups[tp]
    model = build_model(config, group, seed, dtype)
    capture, logits = run_captured(model, input_ids, [Position.parse(p, config.num_hidden_layers) for p in positions])
    records = list(group.tracer.records)
    try:  # the experts each token picked per MoE layer, to leave routing near-ties out of comparisons
        from tpsim.run.jobs import routing_rows
        picked = {k: v.cpu() for k, v in routing_rows(model).items()}
    except Exception:  # noqa: BLE001 (a MoE that no longer records its choice)
        picked = None
    return {"rank": ctx.rank, "group_rank": group.rank, "device": str(capture.device), "capture": capture.cpu(),
            "logits_finite": bool(torch.isfinite(logits).all()), "routing": picked,
            "all_reduces": sum(r.op == "all_reduce" for r in records)}
