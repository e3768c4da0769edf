"""Context parallelism's token shards: rank r of a group holds the contiguous tokens
`offset .. offset + sizes[r]` of one sequence, and attention reads every rank's keys and values.

Attention layers take a `TokenShards` to all-gather what the KV cache holds (one all-gather per
layer) and to mask causally by global token index: a query at global index i sees keys 0..i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpsim.parallel.group import TPGroup


@dataclass(frozen=True)
class TokenShards:
    """`sizes[r]` tokens on rank r of `group`, in token order (rank 0 the first)."""

    group: TPGroup
    sizes: tuple[int, ...]

    @property
    def offset(self) -> int:
        """The global index of this rank's first token."""
        return sum(self.sizes[:self.group.rank])

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def gather(self, x: torch.Tensor, caller: str) -> torch.Tensor:
        """Every rank's rows of `x` `[sizes[r], ...]`, in token order `[total, ...]` (one all-gather)."""
        return self.group.gather_rows(x, list(self.sizes), caller)

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `x` `[total, ...]` in token order."""
        return x[self.offset:self.offset + self.sizes[self.group.rank]]

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """`[own, total]` bool: this rank's query i (global index offset + i) sees keys 0..offset + i."""
        own = self.sizes[self.group.rank]
        queries = torch.arange(own, device=device)[:, None] + self.offset
        return torch.arange(self.total, device=device)[None, :] <= queries
