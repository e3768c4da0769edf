"""Seeded weights: master weight then split.

Every tensor of the Hugging Face checkpoint is generated full size, in float32, on the
CPU, from a generator seeded by (model seed, tensor name), then each rank copies its slice.
So TP=1 and TP=8 hold bit-identical weights, and one tensor's values never depend on
which other tensors exist.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import nullcontext

import torch


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full float32 tensor `name` for model seed `seed`.

    Linear weights ~ N(0, 1/fan_in); embeddings ~ N(0, 1); norm weights ~ 1 + N(0, 0.1²)
    (not all ones, so a norm applied to the wrong slice shows); the noaux_tc correction
    bias ~ N(0, 0.05²).
    """
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * x
    if name.endswith("e_score_correction_bias"):
        return 0.05 * x
    if name.endswith("embed_tokens.weight") or len(shape) == 1:
        return x
    return x / shape[-1] ** 0.5


def weight_specs(module: torch.nn.Module):
    """Every checkpoint tensor a module (a layer or the whole model) loads: the leaf layers'
    WeightSpecs (HF name, full shape, loader into this rank's slice)."""
    for m in module.modules():
        if hasattr(m, "weight_specs"):
            yield from m.weight_specs()


def fill_weights(model: torch.nn.Module, open_source, what: str, progress=None) -> None:
    """Fill every parameter of `model`: `open_source(spec)` is a context manager that gives what
    `spec.load` indexes (a full tensor, or a lazy checkpoint slice). `progress(msg)` hears how
    far it got every couple of seconds (a full-size model takes minutes; the pool's stall
    watchdog counts silence, not total time)."""
    specs = list(weight_specs(model))
    last = time.monotonic()
    for i, spec in enumerate(specs):
        with open_source(spec) as src:
            spec.load(src)
        if progress is not None and time.monotonic() - last > 2:
            progress(f"{what}: {i + 1}/{len(specs)} tensors")
            last = time.monotonic()


def init_random_weights(model: torch.nn.Module, seed: int, progress=None) -> None:
    """Fill every parameter of a tpsim model or layer (any TP degree) from `seed`."""
    fill_weights(model, lambda spec: nullcontext(init_tensor(seed, spec.name, spec.shape)), "seeding weights",
                 progress)
