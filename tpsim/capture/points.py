"""Named capture points: activations inside the model, each with its per-rank placement.

A point is named like the module that produces it, without the `model.` prefix and with
`self_attn` shortened to `attn` (`layers.3.attn.o_proj.partial`). Placements use the
vocabulary of `torch.distributed.tensor`: `Replicate()` (every rank holds the full tensor),
`Shard(dim=-1)` (each rank holds a contiguous 1/tp of the last dim, in rank order),
`Partial(sum)` (each rank holds a summand; the tensor is their sum, i.e. before an
all-reduce), `Shard(dim=0)` (each rank holds its share of the tokens: sequence parallelism,
a scattered MoE output, or dp-attention's own sequences). At TP=1 every point is `Replicate()`.

The layers declare their points (tpsim.layers.probe); `catalogue(cfg)` lists every point of a
model from those declarations (for validating `--points` before any rank starts), `Taps`
records what the layers tap in a real run, and a test checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.layers.probe import Lazy, NamedPoint, Sink
from tpsim.model.decoder import CausalLM
from tpsim.parallel.placement import Placement


def catalogue(cfg: ModelConfig) -> list[NamedPoint]:
    """Every named point of the model: (name, placement at TP>1, what it is), in forward order."""
    return CausalLM.points(cfg)


def position_of(point: str) -> str | None:
    """The residual-stream position a boundary point is (`layers.3.out` -> `out(3)`)."""
    if point == "embed.out":
        return "embed"
    if point == "final":
        return "final"
    parts = point.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[2] == "out":
        return f"out({parts[1]})"
    return None


def check_points(cfg: ModelConfig, names: list[str]) -> list[str]:
    known = {n for n, _, _ in catalogue(cfg)}
    for n in names:
        if n not in known:
            raise UsageError(f"--points: unknown point {n!r}; names look like layers.3.attn.o_proj.partial or "
                             f"layers.3.mlp.in (tpsim explain --model M lists every point of a layer)")
    if len(set(names)) != len(names):
        raise UsageError("--points lists a point twice; name each once")
    return names


@dataclass
class Tap:
    placement: Placement
    shape: tuple[int, ...]
    dtype: str
    order: int  # how many collectives this rank had run when the point was produced
    tensor: torch.Tensor | None = None


@dataclass
class Taps(Sink):
    """A capture of named points (attached to a model's probe): the wanted points' tensors
    (cloned: an all-reduce works in place), or, with `everything`, every point's shape and
    placement only (for explain)."""

    wanted: set[str] = field(default_factory=set)
    everything: bool = False
    watch_finite: bool = False  # find the first point (and token) holding NaN or Inf
    got: dict[str, Tap] = field(default_factory=dict)
    first_nonfinite: tuple[str, int] | None = None
    hears_points = True

    def point(self, name: str, x: Lazy, placement: Placement, order: int) -> None:
        if self.watch_finite and self.first_nonfinite is None:
            x = x() if callable(x) else x
            bad = ~torch.isfinite(x)
            if bad.any():
                rows = bad.reshape(bad.shape[0], -1).any(-1) if bad.dim() > 1 else bad
                self.first_nonfinite = (name, int(rows.nonzero()[0]))
        if not (self.everything or name in self.wanted):
            return
        x = x() if callable(x) else x
        self.got[name] = Tap(placement, tuple(x.shape), str(x.dtype).removeprefix("torch."), order,
                             x.detach().clone() if name in self.wanted else None)
