"""`tpsim export`: write the seeded model as an HF checkpoint (config.json + safetensors)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tpsim.weights.reader import expected_tensors
from tpsim.weights.export import export_checkpoint, total_bytes
from tpsim.config.loader import load_config, with_overrides
from tpsim.base.errors import UsageError
from tpsim.run.spec import model_path
from tpsim.base.ui import human_bytes, progress_bar

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, option: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = float("nan")
    if unit not in SIZE_UNITS or not 0 < value * SIZE_UNITS.get(unit, 1) < float("inf"):
        raise UsageError(f"{option} {text!r} is not a size such as 5GB, 500MB or 2GiB")
    return max(1, int(value * SIZE_UNITS[unit]))


def cmd_export(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory for the checkpoint")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {out} is not empty; pass --force to replace it, or pick a new directory")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist; create it first")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"--out {out}: directory {out.parent} is not writable")
    dtype = "float32" if args.dtype == "auto" else args.dtype
    shard = parse_size(args.max_shard_size, "--max-shard-size")
    cfg = with_overrides(load_config(model_path(args.model)), args.override or [])
    need, free = total_bytes(cfg, getattr(torch, dtype)), shutil.disk_usage(out.parent).free
    if need > free:
        raise UsageError(f"the {dtype} checkpoint needs {human_bytes(need)} and {out.parent} has "
                         f"{human_bytes(free)} free; free space, pick another --out or --override num_hidden_layers")
    with progress_bar("export", len(expected_tensors(cfg))) as advance:
        files = export_checkpoint(cfg, args.seed, out, dtype, shard, on_tensor=lambda name: advance())
    print(f"wrote {out}: {', '.join(files)} ({human_bytes(need)}, {dtype}, seed {args.seed}, "
          f"{cfg.model_type}, {cfg.num_hidden_layers} layers)")
    return 0
