"""Dense SwiGLU MLP: merged gate/up (column-parallel), down (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.capture.points import S, point_name
from tpsim.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tpsim.parallel.group import TPGroup


class DenseMLP(nn.Module):
    """`[T, hidden]` Replicate() → `[T, hidden]`: Replicate() after down_proj's all-reduce, or
    Partial() when `reduce_results=False` (shared and routed experts, reduced once by the MoE)."""

    def __init__(self, hidden: int, intermediate: int, group: TPGroup, prefix: str, dtype: torch.dtype,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], group, f"{prefix}.gate_up_proj", dtype,
            hf_names=[f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"])
        self.group, self.point, self.reduce_results = group, point_name(prefix), reduce_results
        self.down_proj = RowParallelLinear(intermediate, hidden, group, f"{prefix}.down_proj", dtype,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if self.reduce_results:  # a dense MLP, not one expert's share inside the MoE
            self.group.tap(f"{self.point}.act", act, S)
        return self.down_proj(act)
