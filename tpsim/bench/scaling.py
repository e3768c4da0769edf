"""The TP scaling table: seconds per plain forward at every TP degree over one self-spawned pool
(benchmarks/forward_tp.py, forward.py's CPU table)."""

from __future__ import annotations

import statistics
import time

import torch

from tpsim.bench.flops import tp_all_reduces
from tpsim.bench.jobs import forward_sweep_job
from tpsim.base.errors import UsageError
from tpsim.parallel.launch import default_backend
from tpsim.parallel.pool import RankPool


def tp_table(cfg, tps: list[int], tokens: list[int], dtype: str, seed: int, warmup: int, repeats: int, progress,
             device: str = "cpu", timeout_s: float = 300.0) -> dict:
    """Seconds per plain forward at each TP degree, over one self-spawned pool of max(tps) ranks:
    NCCL with one GPU per rank on CUDA (a degree needing more GPUs than there are is skipped with
    the reason, as is one the config cannot split), gloo on the CPU. Per iteration the slowest
    rank counts, then the median; all-reduces counted and timed from the trace
    (`forward_sweep_job`), their time per forward the mean over ranks, then the median."""
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
