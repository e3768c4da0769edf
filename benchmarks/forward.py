"""Forward speed: tpsim with EAGLE-3 capture, tpsim without, and transformers, same weights.

One run builds, on one device, tpsim at TP=1 (`TPGroup(device=...)`, no process group) and
transformers' `DeepseekV2ForCausalLM` (V3 for a V3 config; `attn_implementation` from `--hf-attention`,
auto: "sdpa" where the model class supports it, else "flex_attention" (GPT-OSS on CUDA, its sinks included),
else "eager" (GPT-OSS on the CPU), recorded in the JSON's settings; its default experts implementation)
holding the same seeded weights: each Hugging Face checkpoint tensor is generated once by
`tpsim.weights.seeded.init_tensor` and copied into both models (no checkpoint written). Then, per token count (one sequence each), it times:

- `tpsim+capture`: `model(ids, recorder=Recorder(positions))` + `recorder.concat()`, the sglang
  default capture positions (`tpsim.capture.resolve("sglang-ids", None, L).positions`), logits included;
- `tpsim`: `model(ids)` (logits included);
- `transformers`: `model(input_ids=ids[None], output_hidden_states=True, use_cache=False)`;
- `tpsim+capture graph` (CUDA, up to `--graph-max-tokens` tokens): the first variant captured once
  as a CUDA graph (`tpsim.capture.graphs.GraphedForward`) and replayed; the 8-token target uses it.

All under `torch.inference_mode()`. Timing: `--warmup` untimed calls of each variant, then
`--repeats` rounds, each running every variant once, the order reversed every other round
(A B C, C B A, ...: ABBA interleaving, so drift hits every variant alike). On CUDA each call is
timed with CUDA events after a synchronize (peak memory: `torch.cuda.max_memory_allocated`,
reset before every call); on the CPU with `time.perf_counter`. Reported: median, min, max.

FLOPs of one forward of T tokens (written to the JSON as `flop_formula`):

    flops(T) = 2 * T * P_active + L * T^2 * heads * (qk_head_dim + v_head_dim)

P_active = the matmul weights one token goes through, from the config (`tpsim.bench.flops.active_params`):
per layer MLA q_proj (or q_a_proj + q_b_proj), kv_a_proj_with_mqa, kv_b_proj, o_proj; a dense
MLP's gate/up/down, or an MoE layer's router + shared experts + top_k routed experts (not all
experts); plus lm_head over vocab_size; the embedding lookup is excluded. Attention: causal
prefill counts T^2/2 query-key pairs per head and layer, 2 flops per multiply-add, for QK^T
(qk_head_dim) and PV (v_head_dim). Norms, RoPE, softmax, activations and routing are not counted.
DeepSeek-V2-Lite: P_active = 2.45e9, flops(8192) = 49.4 TFLOP (40.2 matmul + 9.3 attention).

The matmul ceiling is measured in the same run: `torch.mm` of two N x N matrices in the run's
dtype (N = --mm-size, 8192 on CUDA), median of 10, 2 N^3 flops each.

All-reduces per forward: measured from the tpsim model's collective trace (0 at TP=1); the
TP=8 row is the formula 1 + 2L all-reduces of [T, hidden] in the dtype (`tpsim.bench.flops.tp_all_reduces`,
what `tpsim check` counts at TP > 1), not a measurement: the multi-GPU run measures it.

Targets (reported, never asserted): capture overhead <= 0.5 % at 8192 tokens (after the rounds,
`--repeats` back-to-back pairs of tpsim+capture and tpsim, the order alternating, nothing else in
between: the median of the pairs' ratios; the GPU's clock drifts +-4 % between calls on the H200 and
depends on the work before, which a pair cancels. The rounds' ratios and the ratio of the two medians
are reported too); tpsim+capture at
8192 tokens <= 100 ms, >= 1.75x transformers and >= 60 % of the measured matmul rate; at 4096
tokens >= 1.6x; at 8 tokens >= 4x transformers.

`--compile` (default on CUDA): the tpsim variants call tpsim.layers.fused's torch.compile'd kernels
at every token count (the CLI uses them from tpsim.layers.fused.MIN_TOKENS tokens on; compile time
reported as `compile_s`), and `tpsim+capture eager` times the same capture with the eager kernels in the
same rounds, so the ratio of the two is measured in one run.

With `--device cpu` it also runs the CPU TP table: the same config over gloo at TP `--cpu-tp`
(1,2,4,8; `tpsim.bench.scaling.tp_table`) at `--cpu-tp-tokens` (16,64,256): seconds per plain forward
(per iteration the slowest rank, then the median) and its growth relative to the smallest token
count. On GPUs, `benchmarks/forward_tp.py` is the TP table (NCCL, one GPU per rank).

    python benchmarks/forward.py                               # CUDA if available: deepseek-v2-lite, bf16
    python benchmarks/forward.py --device cpu --tokens 8,64 --repeats 3
    python benchmarks/forward.py --override num_hidden_layers=4 --tokens 8,512   # quick trial

Progress goes to stderr, the tables to stdout, the JSON (rewritten after every token count,
so a run stopped early keeps what it measured) to benchmarks/results/forward-{device}.json.
Exit 0 when it ran (targets missed or not), 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .`

import torch  # noqa: E402

from tpsim.base import ui  # noqa: E402
from tpsim.bench.environment import git_commit  # noqa: E402
from tpsim.bench.flops import FLOP_FORMULA, active_params, forward_flops, tp_all_reduces  # noqa: E402
from tpsim.bench.hf import HF_ATTENTION, build_models, hf_attention, hf_unsupported  # noqa: E402
from tpsim.bench.scaling import tp_table  # noqa: E402
from tpsim.capture import PositionKind, Recorder  # noqa: E402
from tpsim.profiles.conventions import resolve  # noqa: E402
from tpsim.config.loader import ModelConfig, load_config, with_overrides  # noqa: E402
from tpsim.base.errors import UsageError  # noqa: E402
from tpsim.base.atomic import write_json  # noqa: E402
from tpsim.layers import fused  # noqa: E402
from tpsim.run.jobs import DTYPES  # noqa: E402
from tpsim.run.spec import input_ids_for  # noqa: E402

VARIANTS = ("tpsim+capture", "tpsim", "transformers")
# issue 17's targets (DeepSeek-V2-Lite bf16, one H200)
TARGETS = {"capture_overhead_pct_max": 0.5, "prefill_tokens": 8192, "prefill_ms_max": 100.0, "prefill_speedup_min": 1.75,
           "prefill_matmul_fraction_min": 0.60, "mid_tokens": 4096, "mid_speedup_min": 1.6, "decode_tokens": 8,
           "decode_speedup_min": 4.0}


# --- arguments --------------------------------------------------------------------------------------------------

def int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r} must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} {text!r}: give positive integers, e.g. 8,512")
    return values


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model, --override, --device, --dtype (this script's and forward_tp.py's)."""
    ap.add_argument("--model", default=None, help="built-in name (tiny, deepseek-v2-lite, deepseek-v3), YAML/JSON "
                    "config or HF model dir (its config only); default deepseek-v2-lite on CUDA, tiny on CPU")
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                    help="change a config field, e.g. num_hidden_layers=4 (repeatable)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto: bfloat16 on CUDA, float32 on CPU")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (one sequence each); "
                    "default 8,512,4096,8192 on CUDA, 8,64,512 on CPU")
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds (each runs every variant once)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each variant per token count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true", help="time tpsim only")
    ap.add_argument("--graph-max-tokens", type=int, default=512,
                    help="CUDA: also time tpsim+capture replayed as a CUDA graph up to this many tokens (default 512)")
    ap.add_argument("--hf-attention", default="auto", choices=["auto", *(name for name, _ in HF_ATTENTION)],
                    help="transformers' attn_implementation; auto: sdpa where its model class supports it, else "
                         "flex_attention, else eager (GPT-OSS: flex_attention on CUDA, its sinks included; eager "
                         "on the CPU)")
    ap.add_argument("--experts-implementation", default=None,
                    help="transformers' experts implementation (eager, grouped_mm, ...); default: its own")
    ap.add_argument("--mm-size", type=int, default=None, help="N of the N x N x N matmul ceiling (8192 CUDA, 1024 CPU)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads of this process (default 1 on CPU, as each rank of the TP table; "
                         "torch's default on CUDA)")
    ap.add_argument("--cpu-tp", default="1,2,4,8", help="CPU only: TP degrees of the gloo table, or 'none'")
    ap.add_argument("--cpu-tp-tokens", default="16,64,256", help="CPU only: token counts of the gloo table")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="tpsim's compiled kernels (tpsim.layers.fused) with an eager variant beside (default: on CUDA)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/forward-{device}.json)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or (args.threads is not None and args.threads < 1):
        ap.error("--repeats and --threads must be at least 1 and --warmup at least 0")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available here; use --device cpu")
    return torch.device(name)


def model_path(text: str) -> Path:
    """A file or directory as given, else a built-in config name (configs/NAME.yaml)."""
    p = Path(text)
    if not p.exists() and (ROOT / "configs" / f"{text}.yaml").is_file():
        return ROOT / "configs" / f"{text}.yaml"
    return p


def load_model_config(text: str, overrides: list[str]) -> ModelConfig:
    return with_overrides(load_config(model_path(text)), overrides)


# --- environment ------------------------------------------------------------------------------------------------

def environment(device: torch.device) -> dict:
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(), "git_commit": git_commit(),
           # 1/5/15-min load averages: other work on the machine skews every timing
           "loadavg_before": os.getloadavg() if hasattr(os, "getloadavg") else None}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update({"gpu": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
                    "gpu_memory_bytes": props.total_memory, "compute_capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda})
    else:
        env["gpu"] = None
    return env


# --- timing -----------------------------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn, device: torch.device) -> dict:
    """One call of fn: ms, and on CUDA the peak memory during it (absolute, and above what was
    allocated before it: activations and workspace)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t0) * 1e3
        del out
        return {"ms": ms, "peak_bytes": None, "extra_bytes": None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return {"ms": start.elapsed_time(end), "peak_bytes": peak, "extra_bytes": peak - base}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10, warmup: int = 3) -> dict:
    """The dense matmul ceiling of this device in this dtype: N x N @ N x N torch.mm, median."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(warmup):
        torch.mm(a, b)
    ms = [timed_call(lambda: torch.mm(a, b), device)["ms"] for _ in range(repeats)]
    med = statistics.median(ms)
    a = b = None  # noqa: F841 (free them before the models are built)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "ms": ms, "median_ms": med,
            "tflops": 2 * n ** 3 / (med / 1e3) / 1e12}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def time_variants(fns: dict, warmup: int, repeats: int, device: torch.device, progress) -> dict:
    """{variant: {"calls": [timed_call...], "error": str|None}}; ABBA order, warm-up first."""
    res = {name: {"calls": [], "error": None} for name in fns}
    names = list(fns)

    def call(name, timed: bool):
        if res[name]["error"]:
            return
        try:
            r = timed_call(fns[name], device)
        except Exception as e:  # noqa: BLE001 (one variant failing must not lose the others' numbers)
            res[name]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            progress(f"{name} failed: {res[name]['error']}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if timed:
            res[name]["calls"].append(r)

    for i in range(warmup):
        for name in (names if i % 2 == 0 else names[::-1]):
            call(name, timed=False)
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            call(name, timed=True)
    return res


def time_pairs(a, b, pairs: int, device: torch.device) -> tuple[list[float], list[float]]:
    """(ms of a, ms of b) over `pairs` back-to-back pairs, the order alternating (a b, b a, ...), after
    one untimed call of each. Only these two run, so each call follows a call of one of them: in the
    rounds, the call before tpsim is tpsim+capture or tpsim+capture eager depending on the round's
    direction, and a GPU's clock depends on the power of the work just before (the H200's tpsim calls
    spread over +-4 %), which the rounds' per-round ratio does not cancel."""
    timed_call(a, device), timed_call(b, device)
    ta, tb = [], []
    for i in range(pairs):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            out.append(timed_call(fn, device)["ms"])
    return ta, tb


# --- one token count ----------------------------------------------------------------------------------------------

def rel_err_f32(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| computed in float32 on the tensors' device (logits are large)."""
    x, ref = x.float(), ref.float()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def hf_index(p, L: int) -> int | None:
    """The index of transformers' output_hidden_states holding position p (None: not there)."""
    if p.kind is PositionKind.EMBED:
        return 0
    if p.kind is PositionKind.FINAL:
        return L
    return p.layer + 1 if p.layer < L - 1 else None


def agreement(model, hf, ids: torch.Tensor, positions, L: int) -> dict:
    """Untimed: tpsim's capture and logits against transformers' hidden states and logits."""
    with torch.inference_mode():
        rec = Recorder(positions)
        logits = model(ids, recorder=rec, logits=True)
        cap = rec.concat()
        out = {"capture_shape": list(cap.shape), "capture_finite": bool(torch.isfinite(cap).all())}
        if hf is not None:
            o = hf(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            idx = [hf_index(p, L) for p in positions]
            if all(i is not None for i in idx):
                ref = torch.cat([o.hidden_states[i][0] for i in idx], dim=-1)
                out["capture_rel_err_vs_transformers"] = rel_err_f32(cap, ref)
            out["logits_rel_err_vs_transformers"] = rel_err_f32(logits, o.logits[0])
            del o
        del logits, cap, rec
    return out


def summarize(T: int, cfg: ModelConfig, dtype: str, timing: dict, mm: dict, model_tracer_records,
              pairs: tuple[list[float], list[float]] | None = None) -> dict:
    """One token count's row; `pairs`: (tpsim+capture ms, tpsim ms) from `time_pairs`, the capture
    overhead's paired estimate (else the rounds' per-round ratio)."""
    flops = forward_flops(cfg, T)
    row = {"tokens": T, "flops": flops, "variants": {}}
    for name, r in timing.items():
        ms = [c["ms"] for c in r["calls"]]
        v = {"error": r["error"], "n": len(ms)}
        if ms:
            med = statistics.median(ms)
            v.update({"ms": ms, "median_ms": med, "min_ms": min(ms), "max_ms": max(ms),
                      "tokens_per_s": T / (med / 1e3), "tflops": flops["total"] / (med / 1e3) / 1e12})
            v["matmul_fraction"] = v["tflops"] / mm["tflops"] if mm else None
            peaks = [c["peak_bytes"] for c in r["calls"] if c["peak_bytes"] is not None]
            extras = [c["extra_bytes"] for c in r["calls"] if c["extra_bytes"] is not None]
            v["peak_bytes"] = max(peaks) if peaks else None
            v["peak_extra_bytes"] = max(extras) if extras else None
        row["variants"][name] = v
    V = row["variants"]
    hf_ms = V.get("transformers", {}).get("median_ms")
    for name in ("tpsim+capture", "tpsim", "tpsim+capture graph", "tpsim+capture eager"):
        if V.get(name, {}).get("median_ms"):
            V[name]["speedup_vs_transformers"] = hf_ms / V[name]["median_ms"] if hf_ms else None
    w, wo = V.get("tpsim+capture", {}), V.get("tpsim", {})
    if w.get("median_ms") and wo.get("median_ms"):
        row["capture_overhead_pct"] = (w["median_ms"] / wo["median_ms"] - 1) * 100
        # the same round holds one call of each: the median of the per-round ratios
        row["capture_overhead_rounds_pct"] = (statistics.median(a / b for a, b in zip(w["ms"], wo["ms"])) - 1) * 100
        row["capture_overhead_paired_pct"] = row["capture_overhead_rounds_pct"]
    if pairs is not None and pairs[0] and pairs[1]:
        row["capture_overhead_pairs"] = {"with_ms": pairs[0], "without_ms": pairs[1], "n": len(pairs[0])}
        row["capture_overhead_paired_pct"] = (statistics.median(a / b for a, b in zip(*pairs)) - 1) * 100
    row["all_reduces"] = {
        "tp1_measured": {"all_reduces": sum(r.op == "all_reduce" for r in model_tracer_records),
                         "bytes": sum(r.bytes for r in model_tracer_records if r.op == "all_reduce"),
                         "source": "the tpsim model's group.tracer over one captured forward"},
        "tp8_formula": {**tp_all_reduces(cfg, T, dtype, 8),
                        "source": "formula 1 + 2L all-reduces of [T, hidden] in the dtype; not measured here "
                                  "(the multi-GPU run measures it)"},
    }
    return row


# --- targets ------------------------------------------------------------------------------------------------------

def targets(rows: list[dict], mm: dict | None) -> list[dict]:
    by_t = {r["tokens"]: r for r in rows}
    P, D = TARGETS["prefill_tokens"], TARGETS["decode_tokens"]
    out = []

    def add(name, want, value, met, how):
        out.append({"target": name, "want": want, "value": value, "met": met, "detail": how})

    r = by_t.get(P)
    if r is None or r.get("capture_overhead_pct") is None:
        add(f"capture overhead at {P} tokens", f"<= {TARGETS['capture_overhead_pct_max']}%", None, None,
            f"not measured ({P} tokens not run)" if r is None else "not measured (a tpsim variant failed)")
    else:  # the paired estimate: time_pairs' back-to-back pairs (the rounds' ratio when the pairs did not run)
        v, lim = r["capture_overhead_paired_pct"], TARGETS["capture_overhead_pct_max"]
        add(f"capture overhead at {P} tokens", f"<= {lim}%", v, v <= lim,
            f"met: {v:+.2f}% (medians {r['capture_overhead_pct']:+.2f}%)" if v <= lim
            else f"missed: {v:+.2f}% is {v - lim:.2f} percentage points over (medians "
                 f"{r['capture_overhead_pct']:+.2f}%)")
    r = by_t.get(P)
    ms = None if r is None else r["variants"].get("tpsim+capture", {}).get("median_ms")
    lim = TARGETS["prefill_ms_max"]
    if ms is None:
        add(f"tpsim+capture at {P} tokens", f"<= {lim:.0f} ms", None, None, "not measured")
    else:
        add(f"tpsim+capture at {P} tokens", f"<= {lim:.0f} ms", ms, ms <= lim, f"met: {ms:.1f} ms" if ms <= lim
            else f"missed: {ms:.1f} ms; needs {ms / lim:.2f}x faster")
    for T, lim in ((P, TARGETS["prefill_speedup_min"]), (TARGETS["mid_tokens"], TARGETS["mid_speedup_min"]),
                   (D, TARGETS["decode_speedup_min"])):
        r = by_t.get(T)
        variant = "tpsim+capture graph" if r is not None and "tpsim+capture graph" in r["variants"] else "tpsim+capture"
        s = None if r is None else r["variants"].get(variant, {}).get("speedup_vs_transformers")
        name = f"{variant} vs transformers at {T} tokens"
        if s is None:
            add(name, f">= {lim}x", None, None, f"not measured ({T} tokens not run)" if r is None
                else "not measured (transformers skipped or a variant failed)")
        else:
            add(name, f">= {lim}x", s, s >= lim, f"met: {s:.2f}x" if s >= lim
                else f"missed: {s:.2f}x; tpsim must get {lim / s:.2f}x faster")
    r = by_t.get(P)
    f = None if r is None else r["variants"].get("tpsim+capture", {}).get("matmul_fraction")
    lim = TARGETS["prefill_matmul_fraction_min"]
    name = f"tpsim+capture at {P} tokens vs measured matmul rate"
    if f is None:
        add(name, f">= {lim:.0%}", None, None, f"not measured ({P} tokens not run)" if r is None else "not measured")
    else:
        add(name, f">= {lim:.0%}", f, f >= lim, f"met: {f:.1%} of {mm['tflops']:.0f} TFLOP/s" if f >= lim
            else f"missed: {f:.1%} of {mm['tflops']:.0f} TFLOP/s; needs {lim / f:.2f}x the throughput")
    return out


# --- CPU TP table -----------------------------------------------------------------------------------------------

# --- output -------------------------------------------------------------------------------------------------------

def gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def print_tables(result: dict) -> None:
    s = result["settings"]
    mm = result.get("matmul")
    title = (f"forward: {result['config']['name']} (L={result['config']['num_hidden_layers']}), {s['dtype']} on "
             f"{result['environment'].get('gpu') or 'CPU'}, TP=1; capture {result['capture']['positions_text']}; "
             f"transformers attn={s.get('attn_implementation') or '-'}, "
             f"experts={s.get('experts_implementation') or '-'}, output_hidden_states, "
             f"use_cache=False; median of {s['repeats']} (ABBA)")
    cols = ["tokens", "variant", "ms median", "min-max", "tok/s", "vs transformers", "capture ovh", "TFLOP/s",
            "% of mm", "peak GB", "+act GB"]
    rows = []
    for r in result["rows"]:
        for name, v in r["variants"].items():
            if v.get("error") and not v.get("median_ms"):
                rows.append([str(r["tokens"]), name, "failed", v["error"][:60], *["-"] * 7])
                continue
            sp = v.get("speedup_vs_transformers")
            ovh = r.get("capture_overhead_pct") if name == "tpsim+capture" else None
            rows.append([str(r["tokens"]), name, f"{v['median_ms']:.2f}", f"{v['min_ms']:.2f}-{v['max_ms']:.2f}",
                         f"{v['tokens_per_s']:,.0f}", "-" if sp is None else f"{sp:.2f}x",
                         "-" if ovh is None else f"{ovh:+.2f}%", f"{v['tflops']:.3g}",
                         "-" if v.get("matmul_fraction") is None else f"{v['matmul_fraction']:.1%}",
                         gb(v.get("peak_bytes")), gb(v.get("peak_extra_bytes"))])
    ui.titled_table(title, cols, rows)
    if mm:
        ui.stdout.print(f"matmul ceiling: {mm['n']}x{mm['n']}x{mm['n']} torch.mm in {mm['dtype']}: "
                        f"{mm['tflops']:.3g} TFLOP/s (median of {len(mm['ms'])})")
    ui.stdout.print(f"FLOPs: {FLOP_FORMULA}; P_active = {result['active_params']['total']:,}")
    ar = [[str(r["tokens"]), str(r["all_reduces"]["tp1_measured"]["all_reduces"]),
           f"{r['all_reduces']['tp1_measured']['bytes']:,}", str(r["all_reduces"]["tp8_formula"]["all_reduces"]),
           f"{r['all_reduces']['tp8_formula']['bytes']:,}"] for r in result["rows"]]
    ui.titled_table("all-reduces per forward (TP=1 measured from the tracer; TP=8 by formula, not measured)",
                             ["tokens", "TP=1", "TP=1 bytes", "TP=8 (formula)", "TP=8 bytes/rank (formula)"], ar)
    checks = [[str(r["tokens"]), str(r["check"].get("capture_shape")),
               "yes" if r["check"].get("capture_finite") else "NO",
               "-" if r["check"].get("capture_rel_err_vs_transformers") is None
               else f"{r['check']['capture_rel_err_vs_transformers']:.2e}",
               "-" if r["check"].get("logits_rel_err_vs_transformers") is None
               else f"{r['check']['logits_rel_err_vs_transformers']:.2e}"] for r in result["rows"] if "check" in r]
    if checks:
        ui.titled_table("same computation? (untimed; bf16 differs by rounding and routing near-ties)",
                                 ["tokens", "capture shape", "finite", "capture rel err vs HF", "logits rel err vs HF"],
                                 checks)
    tg = [[t["target"], t["want"], "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED"), t["detail"]]
          for t in result["targets"]]
    ui.titled_table("targets (reported, not asserted; set for DeepSeek-V2-Lite bf16 on one H200)",
                             ["target", "want", "status", "detail"], tg)
    cpu = result.get("cpu_tp")
    if cpu:
        ui.titled_table(
            f"CPU over gloo: seconds per forward (median of the slowest rank, {cpu['repeats']} repeats), "
            f"{cpu['dtype']}, one torch thread per rank, {os.cpu_count()} cores",
            ["TP", "tokens", "s/forward", "min-max", "x vs smallest", "tok/s", "all-reduces (formula)", "bytes/rank"],
            [[str(r["tp"]), str(r["tokens"]), f"{r['median_s']:.4f}", f"{r['min_s']:.4f}-{r['max_s']:.4f}",
              f"{r['growth_vs_smallest']:.2f}", f"{r['tokens_per_s']:,.0f}",
              f"{r['all_reduces']} ({r['all_reduces_formula']})", f"{r['all_reduce_bytes']:,}"] for r in cpu["rows"]])
        for s_ in cpu["skipped"]:
            ui.stdout.print(f"skipped TP={s_['tp']}: {s_['reason']}")


def main(argv=None) -> int:
    args = parse_args(argv)
    progress = ui.ProgressLine()
    try:
        device = resolve_device(args.device)
        cuda = device.type == "cuda"
        dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
        cfg = load_model_config(args.model or ("deepseek-v2-lite" if cuda else "tiny"), args.override)
        tokens = int_list(args.tokens or ("8,512,4096,8192" if cuda else "8,64,512"), "--tokens")
        cpu_tps = [] if args.cpu_tp.strip().lower() in ("none", "") or cuda else int_list(args.cpu_tp, "--cpu-tp")
        cpu_tokens = int_list(args.cpu_tp_tokens, "--cpu-tp-tokens")
        if max(tokens) > cfg.max_position_embeddings:
            raise UsageError(f"--tokens {max(tokens)} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        attention = None
        if not args.skip_transformers:
            importlib.import_module("transformers")  # fail now, with the fix, not after building tpsim
            if hf_unsupported(cfg):
                raise UsageError(hf_unsupported(cfg))
            attention = hf_attention(cfg, args.hf_attention, device)
    except UsageError as e:
        print(f"forward: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("forward: error: transformers is not installed; pip install -e '.[test]' or pass --skip-transformers",
              file=sys.stderr)
        return 2
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > (os.cpu_count() or 1):
        print(f"forward: note: load average {load:.1f} on {os.cpu_count()} cores: other work skews the timings",
              file=sys.stderr)
    if args.repeats < 5:
        print(f"forward: note: --repeats {args.repeats} < 5: the medians are rough", file=sys.stderr)
    if args.threads or not cuda:
        torch.set_num_threads(args.threads or 1)
    if cuda:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    model_name = args.model or ("deepseek-v2-lite" if cuda else "tiny")
    model_name = Path(model_name).stem if Path(model_name).is_file() else Path(model_name).name
    L = cfg.num_hidden_layers
    res = resolve("sglang-ids", None, L)
    out_path = Path(args.out or ROOT / "benchmarks" / "results" / f"forward-{device.type}.json")
    t_start = time.perf_counter()
    result = {
        "benchmark": "forward", "complete": False,
        "environment": environment(device),
        "config": {"name": model_name, "overrides": args.override, "sha256": cfg.sha256(), "num_hidden_layers": L,
                   "hidden_size": cfg.hidden_size, "model_type": cfg.model_type, "fields": cfg.to_dict()},
        "settings": {"device": str(device), "dtype": dtype, "tokens": tokens, "repeats": args.repeats,
                     "warmup": args.warmup, "seed": args.seed, "tp": 1, "batch": 1,
                     "transformers": not args.skip_transformers, "attn_implementation": attention,
                     "experts_implementation": None, "use_cache": False, "timer": "cuda events" if cuda else
                     "time.perf_counter", "order": "ABBA: rounds alternate the variant order"},
        "capture": {"convention": "sglang-ids", "ids": res.internal, "positions": [str(p) for p in res.positions],
                    "positions_text": res.positions_text},
        "flop_formula": FLOP_FORMULA, "active_params": active_params(cfg),
        "targets_spec": TARGETS, "rows": [],
    }

    mm = None
    try:
        n = args.mm_size or (8192 if cuda else 1024)
        progress(f"matmul ceiling: {n}^3 torch.mm in {dtype}")
        mm = matmul_rate(device, DTYPES[dtype], n)
        result["matmul"] = mm
    except Exception as e:  # noqa: BLE001
        result["matmul"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        progress(f"matmul ceiling failed: {e}")

    progress(f"building tpsim{'' if args.skip_transformers else ' and transformers'}: {model_name}, L={L}, {dtype}, "
             f"{device}, seed {args.seed}")
    t0 = time.perf_counter()
    try:
        model, hf = build_models(cfg, args.seed, dtype, device, transformers=not args.skip_transformers,
                                 attn_implementation=attention, experts_implementation=args.experts_implementation,
                                 progress=progress)
    except UsageError as e:  # a config transformers cannot hold (moe_layer_freq > 1)
        print(f"forward: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 (transformers changed under us: still time tpsim)
        if args.skip_transformers:
            raise
        result["transformers_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"forward: transformers could not be built ({result['transformers_error']}); timing tpsim only",
              file=sys.stderr)
        model = None
    if model is None:  # outside the except block, so the failed attempt's tensors are freed first
        if cuda:
            torch.cuda.empty_cache()
        model, hf = build_models(cfg, args.seed, dtype, device, transformers=False, progress=progress)
    result["build_s"] = time.perf_counter() - t0
    if hf is not None:
        result["settings"]["experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
        result["settings"]["transformers_class"] = type(hf).__name__
    if cuda:
        result["weights_bytes_on_gpu"] = torch.cuda.memory_allocated(device)
    progress(f"built in {result['build_s']:.0f} s")
    positions = list(res.positions)

    compiled = cuda if args.compile is None else args.compile
    model.kernels = fused.KernelPolicy(compiled, min_tokens=1)  # every token count: the table shows where it pays
    result["settings"]["compiled"] = compiled
    for T in tokens:
        ids = torch.tensor(input_ids_for(cfg, args.seed, T), dtype=torch.long, device=device)
        ids2 = ids[None]

        def with_capture():
            rec = Recorder(positions)
            model(ids, recorder=rec, logits=True)
            return rec.concat()

        fns = {"tpsim+capture": with_capture, "tpsim": lambda: model(ids, logits=True)}
        if compiled:
            def eager_capture():
                model.kernels = fused.EAGER_POLICY
                try:
                    return with_capture()
                finally:
                    model.kernels = fused.KernelPolicy(True, min_tokens=1)
            fns["tpsim+capture eager"] = eager_capture
            t1 = time.perf_counter()
            with torch.inference_mode():
                with_capture()
                model(ids, logits=True)
            sync(device)
            result.setdefault("compile_s", {})[str(T)] = time.perf_counter() - t1
        if cuda and T <= args.graph_max_tokens:  # the decode/verify regime: launch-bound, replay a CUDA graph
            from tpsim.capture.graphs import GraphedForward
            with torch.inference_mode():
                graphed = GraphedForward(model, T, positions)
            fns["tpsim+capture graph"] = lambda: graphed(ids)
        if hf is not None:
            fns["transformers"] = lambda: hf(input_ids=ids2, output_hidden_states=True, use_cache=False)
        progress(f"{T} tokens: {args.warmup} warm-up + {args.repeats} timed rounds of {', '.join(fns)}")
        t0 = time.perf_counter()
        with torch.inference_mode():
            timing = time_variants(fns, args.warmup, args.repeats, device, progress)
            model.group.tracer.clear()
            try:
                with_capture()
            except Exception:  # noqa: BLE001 (already recorded as the variant's error)
                pass
            records = list(model.group.tracer.records)
            pairs = None
            if not (timing["tpsim+capture"]["error"] or timing["tpsim"]["error"]):
                progress(f"{T} tokens: {args.repeats} back-to-back pairs of tpsim+capture and tpsim")
                pairs = time_pairs(fns["tpsim+capture"], fns["tpsim"], args.repeats, device)
        row = summarize(T, cfg, dtype, timing, mm if mm and "tflops" in mm else None, records, pairs)
        try:
            row["check"] = agreement(model, hf, ids, positions, L)
        except Exception as e:  # noqa: BLE001
            row["check"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if cuda:
            torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t0
        result["rows"].append(row)
        med = {k: v.get("median_ms") for k, v in row["variants"].items()}
        progress(f"{T} tokens done in {row['wall_s']:.0f} s: " + ", ".join(
            f"{k} {'failed' if v is None else f'{v:.2f} ms'}" for k, v in med.items()))
        result["targets"] = targets(result["rows"], mm)
        write_json(out_path, result)  # partial results survive a run stopped early

    model = hf = None  # free both before the CPU TP table
    if cuda:
        torch.cuda.empty_cache()
    if cpu_tps and device.type == "cpu":
        progress(f"CPU TP table: TP {','.join(map(str, cpu_tps))} over gloo at {','.join(map(str, cpu_tokens))} tokens")
        result["cpu_tp"] = tp_table(cfg, cpu_tps, cpu_tokens, dtype, args.seed, min(args.warmup, 1), args.repeats,
                                    progress)
    progress.stop()
    result["targets"] = targets(result["rows"], mm)
    result["complete"] = True
    result["wall_s"] = time.perf_counter() - t_start
    result["environment"]["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    write_json(out_path, result)
    print_tables(result)
    print(f"wrote {out_path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
