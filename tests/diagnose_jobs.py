"""Rank-pool jobs for tests/test_diagnose.py: genuine per-rank tensors from real collectives.

Pickled by reference (module `diagnose_jobs`): spawn hands the children the parent's
sys.path, which under pytest holds tests/ (rootdir conftest, prepend import mode).
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def inputs(seed: int, T: int, d_in: int, H: int, dtype: str) -> dict[str, torch.Tensor]:
    """x `[T, d_in]`, a row-parallel weight and a column-parallel weight `[H, d_in]` (full, seeded)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(DTYPES[dtype])
            for k, shape in (("x", (T, d_in)), ("w_row", (H, d_in)), ("w_col", (H, d_in)))}


def collectives_job(ctx, seed: int, T: int, d_in: int, H: int, dtypes: list[str], tps: list[int]):
    """For each (TP degree this rank takes part in, dtype), this rank's local tensors:
    - `partial`: a row-parallel matmul before its all-reduce, Partial(sum) `[T, H]`;
    - `reduced`: its all-reduce, Replicate();
    - `scattered`: its reduce-scatter over tokens, Shard(dim=0) `[T/tp, H]`;
    - `local`: a column-parallel matmul's output, Shard(dim=-1) `[T, H/tp]`;
    - `gathered`: that output all-gathered along the hidden dim, Replicate()."""
    out = {}
    for tp in tps:
        if not ctx.participates(tp):
            continue
        g = ctx.groups[tp]
        for dtype in dtypes:
            t = inputs(seed, T, d_in, H, dtype)
            cols = slice(g.rank * d_in // tp, (g.rank + 1) * d_in // tp)
            partial = t["x"][:, cols] @ t["w_row"][:, cols].T
            local = t["x"] @ t["w_col"][g.rank * H // tp:(g.rank + 1) * H // tp].T
            out[tp, dtype] = {"partial": partial, "reduced": g.all_reduce(partial.clone(), "row"),
                              "scattered": g.reduce_scatter(partial.clone(), "row", dim=0),
                              "local": local, "gathered": g.all_gather(local, "col", dim=-1)}
    return out
