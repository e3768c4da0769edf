"""RMSNorm with the fused residual add of vLLM/SGLang (`fused_add_rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from tpsim.layers.fused import kernels
from tpsim.layers.linear import WeightSpec, _copy
from tpsim.parallel.group import TPGroup


class RMSNorm(nn.Module):
    """Replicated weight `[dim]`.

    `norm(x)` → normalised x. `norm(x, residual)` → `(normalised(x + residual), x + residual)`:
    the add is done in float32 and the sum, cast back to x's dtype, is the new residual.
    """

    def __init__(self, dim: int, eps: float, group: TPGroup, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.eps, self.prefix = eps, prefix
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=group.device), requires_grad=False)

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", tuple(self.weight.shape), lambda t: _copy(self.weight, t[:]))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return kernels().rms_norm(x, self.weight, self.eps)
        return kernels().add_rms_norm(x, residual, self.weight, self.eps)
