"""Copying named tensors into the draft through tpsim's `WeightSpec`s (the checkpoint's names)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tpsim.draft.model import Eagle3Draft
from tpsim.layers.linear import WeightSpec


def specs(model: Eagle3Draft) -> dict[str, WeightSpec]:
    out = {}
    for module in model.modules():
        if hasattr(module, "weight_specs"):
            out.update({s.name: s for s in module.weight_specs()})
    return out


def load(model: Eagle3Draft, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Copies every tensor the draft has a place for; returns the names it had no place for.
    A weight absent from `tensors` keeps its value (the caller's findings say so)."""
    places = specs(model)
    unused = []
    for name, t in tensors.items():
        if name == "d2t":
            model.d2t.copy_(t.to(torch.long))
        elif name in places:
            if tuple(t.shape) != places[name].shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the draft expects {places[name].shape}")
            places[name].load(t)
        elif name != "t2d":
            unused.append(name)
    return unused


def tensors_of(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The inverse of `load` for a draft on one rank: every weight under the checkpoint's names (a fused
    q/k/v or gate/up parameter split back in the order its specs list, an embedding's padding rows dropped),
    plus `d2t`."""
    out = {}
    for module in model.modules():
        if not hasattr(module, "weight_specs"):
            continue
        module_specs = list(module.weight_specs())
        rows = [s.shape[0] for s in module_specs]
        parts = module.weight.detach()[:sum(rows)].split(rows, dim=0)  # [:sum]: a vocab padded to a multiple
        for s, part in zip(module_specs, parts):
            if tuple(part.shape) != s.shape:
                raise ValueError(f"{s.name}: {tuple(part.shape)} on this rank, {s.shape} in the checkpoint (TP > 1)")
            out[s.name] = part.clone()
    out["d2t"] = model.d2t.clone()
    return out
