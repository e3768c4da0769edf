"""Named capture points: activations inside the model, each with its per-rank placement.

A point is named like the module that produces it, without the `model.` prefix and with
`self_attn` shortened to `attn` (`layers.3.attn.o_proj.partial`). Placements use the
vocabulary of `torch.distributed.tensor`: `Replicate()` (every rank holds the full tensor),
`Shard(dim=-1)` (each rank holds a contiguous 1/tp of the last dim, in rank order),
`Partial(sum)` (each rank holds a summand; the tensor is their sum, i.e. before an
all-reduce), `Shard(dim=0)` (each rank holds its share of the tokens: sequence parallelism,
a scattered MoE output, or dp-attention's own sequences). At TP=1 every point is `Replicate()`.

`catalogue(cfg)` lists every point of a model statically (for validating `--points` before
any rank starts); the layers report the same points from real runs through `TPGroup.tap`,
and a test checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.config import ModelConfig
from tpsim.errors import UsageError
from tpsim.parallel.placement import P, R, S1, Placement



def point_name(prefix: str) -> str:
    """`model.layers.3.self_attn.o_proj` -> `layers.3.attn.o_proj`."""
    return prefix.removeprefix("model.").replace(".self_attn", ".attn")


def layer_points(cfg: ModelConfig, k: int) -> list[tuple[str, Placement, str]]:
    """(name, placement at TP>1, what it is) of decoder layer k, in forward order."""
    p = f"layers.{k}."
    pts = [
        (p + "attn.in", R, "input_layernorm(hidden + residual): what attention reads"),
        (p + "attn.q", S1, "q_proj / q_b_proj output: this rank's heads"),
        (p + "attn.kv_latent", R, "kv_a_layernorm(compressed kv): the latent every head shares"),
        (p + "attn.kv", S1, "kv_b_proj output (k_nope, v): this rank's heads"),
        (p + "attn.out", S1, "attention output, this rank's heads: o_proj's input"),
        (p + "attn.o_proj.partial", P, "o_proj output before its all-reduce"),
        (p + "attn.o_proj.out", R, "o_proj output after its all-reduce"),
        (p + "mid", R, "residual stream between attention and MLP (hidden + residual)"),
        (p + "mlp.in", R, "post_attention_layernorm output: what the MLP/MoE reads"),
    ]
    if cfg.is_moe_layer(k):
        pts += [(p + "mlp.router_logits", R, "router logits (float32), replicated gate"),
                (p + "mlp.partial", P, "routed * routed_scaling_factor + shared, before the one all-reduce"),
                (p + "mlp.out", R, "MoE output after its all-reduce")]
    else:
        pts += [(p + "mlp.act", S1, "silu(gate) * up: this rank's intermediate columns"),
                (p + "mlp.down_proj.partial", P, "down_proj output before its all-reduce"),
                (p + "mlp.down_proj.out", R, "down_proj output after its all-reduce")]
    pts.append((p + "out", R, f"out({k}) = hidden + residual after layer {k}"))
    return pts


def catalogue(cfg: ModelConfig) -> list[tuple[str, Placement, str]]:
    """Every named point of the model, in forward order."""
    pts = [("embed.partial", P, "this rank's vocab rows looked up (zeros elsewhere), before the all-reduce"),
           ("embed.out", R, "embedding output = position embed")]
    for k in range(cfg.num_hidden_layers):
        pts += layer_points(cfg, k)
    pts += [("final", R, "final norm output = position final"),
            ("logits.local", S1, "this rank's slice of the padded vocab logits"),
            ("logits", R, "all-gathered logits, sliced to vocab_size")]
    return pts


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
class Taps:
    """What `TPGroup.tap` records: the wanted points' tensors (cloned: an all-reduce works in
    place), or, with `everything`, every point's shape and placement only (for explain)."""

    wanted: set[str] = field(default_factory=set)
    everything: bool = False
    watch_finite: bool = False  # find the first point (and token) holding NaN or Inf
    got: dict[str, Tap] = field(default_factory=dict)
    first_nonfinite: tuple[str, int] | None = None

    def record(self, name: str, x, placement: Placement, order: int) -> None:
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
