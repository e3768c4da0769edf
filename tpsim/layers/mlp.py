"""Dense SwiGLU MLP: merged gate/up (column-parallel), down (row-parallel)."""

from __future__ import annotations

import torch
from torch import nn

from tpsim.layers.fused import kernels
from tpsim.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tpsim.layers.probe import NamedPoint, Point, Probe, Tapped, point_name
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import S1


class DenseMLP(Tapped, nn.Module):
    """`[T, hidden]` Replicate() → `[T, hidden]`: Replicate() after down_proj's all-reduce, or
    Partial() when `reduce_results=False` (the decoder layer or the MoE reduces)."""

    POINTS = (Point("act", S1, "silu(gate) * up: this rank's intermediate columns"),)

    def __init__(self, hidden: int, intermediate: int, group: TPGroup, prefix: str, dtype: torch.dtype,
                 reduce_results: bool = True, tap_act: bool = True, probe: Probe | None = None,
                 fp8: tuple[int, int] | None = None):
        super().__init__()
        probe = probe or Probe(group)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], group, f"{prefix}.gate_up_proj", dtype,
            hf_names=[f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"], fp8=fp8)
        self.group, self.point, self.probe, self.tap_act = group, point_name(prefix), probe, tap_act
        self.down_proj = RowParallelLinear(intermediate, hidden, group, f"{prefix}.down_proj", dtype,
                                           reduce_results=reduce_results, probe=probe, fp8=fp8)

    @classmethod
    def points(cls, base: str) -> list[NamedPoint]:
        """This MLP's points under `base`, with its down_proj's, in forward order."""
        return cls.declared(base) + RowParallelLinear.declared(f"{base}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = kernels().silu_mul(self.gate_up_proj(x))
        if self.tap_act:  # a dense MLP, not the shared experts inside the MoE
            self.tap("act", act)
        return self.down_proj(act)
