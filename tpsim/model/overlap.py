"""Two-batch overlap's split layers (SGLang `--enable-two-batch-overlap`, tpsim.modes.tbo has the
sources): from layer first_k_dense_replace on, the batch runs as two micro-batches, each through its
own attention and MLP/MoE with its own all-reduces, and is concatenated back before the final norm.

SGLang runs them through `model_forward_maybe_tbo`, outside `DeepseekV2Model.forward`'s capture loop:
the probe hears each micro-batch at each boundary through `micro_batch` only (never `boundary` or
`in_layer`), so a capture that listens where the engine's loop does misses the whole region.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from tpsim.layers.moe import Routing
from tpsim.modes import Stages, Stream
from tpsim.modes.tbo import tbo_split


@dataclass
class Earlier:
    """At one layer: the attention inputs (and positions) of the micro-batches that ran it before
    this one, in token order: what SGLang's KV cache of that layer holds for them when the next
    micro-batch's attention reads it."""

    positions: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)

    def attend(self, attention: Callable, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`attention(positions, x)` for this micro-batch's rows, its queries seeing the earlier
        micro-batches' keys and values. tpsim recomputes those from the earlier attention inputs:
        attention runs over the concatenation in token order and this micro-batch keeps its own (last)
        rows. Causal attention makes that exact for every attention tpsim has, since a row reads only
        rows at or before it: MLA (keys and values from kv_a_proj of the same inputs, RoPE from the
        concatenated positions), GQA, and GPT-OSS's sliding window and per-head sinks (both per query
        row). The output is this rank's partial sum, rows sliced before any reduction."""
        out = attention(torch.cat([*self.positions, positions]), torch.cat([*self.inputs, x]))[-x.shape[0]:] \
            if self.inputs else attention(positions, x)
        self.positions.append(positions)
        self.inputs.append(x)
        return out


def two_batch_overlap(layers, stages: tuple[Stages, ...], positions: torch.Tensor, hidden: torch.Tensor,
                      residual: torch.Tensor, stream: Stream, probe) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `layers` (the split region, first index `layers[0].k`) as SGLang's two micro-batches (the
    two-chunk split of one sequence: tbo_split) → (hidden, residual) of the whole batch, the
    micro-batches' rows concatenated back. Each micro-batch's stream is offered to the probe before
    each layer and after the last (`micro_batch`)."""
    T, L = hidden.shape[0], layers[-1].k + 1
    a, _ = tbo_split(T)
    bounds = ((0, a), (a, T))
    mbs = [[hidden[s:e], residual[s:e]] for s, e in bounds]
    for layer, st in zip(layers, stages):
        earlier, routed = Earlier(), []
        for (s, e), mb in zip(bounds, mbs):
            probe.micro_batch(layer.k, s, T, *mb)
            mb[:] = layer(positions[s:e], *mb, stream, st, micro=earlier)
            if layer.is_moe:
                routed.append(layer.mlp.routing)
        if routed:  # the routing of the whole batch, in token order (check compares routing with TP=1)
            layer.mlp.routing = Routing.cat(routed)
    for (s, _), mb in zip(bounds, mbs):
        probe.micro_batch(L, s, T, *mb)
    return torch.cat([mb[0] for mb in mbs]), torch.cat([mb[1] for mb in mbs])
