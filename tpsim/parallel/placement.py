"""How an activation is laid out over the ranks of a TP group: one type for the whole package.

The names and the printed form are those of `torch.distributed.tensor`'s placements
(`Replicate()`, `Shard(dim=0)`, `Shard(dim=-1)`, `Partial(sum)`); a `Placement` is also its
printed string, so it goes into JSON, file metadata and tables as is and compares equal to
what was read back from them.
"""

from __future__ import annotations

from enum import Enum


class Placement(str, Enum):
    """How one tensor lies across the TP ranks; the value is DTensor's spelling of the placement."""

    REPLICATE = "Replicate()"     # every rank holds the full tensor
    SHARD_ROWS = "Shard(dim=0)"   # each rank its share of the tokens (rows), in rank order
    SHARD_LAST = "Shard(dim=-1)"  # each rank a contiguous 1/tp of the last dim, in rank order
    PARTIAL = "Partial(sum)"      # each rank a summand: the tensor is their sum (before an all-reduce)

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__

    def to_dtensor(self):
        """The `torch.distributed.tensor` placement this one prints as."""
        from torch.distributed import tensor as dtensor  # ~1 s to import (sympy, fake tensors): only when asked
        return {Placement.REPLICATE: dtensor.Replicate(), Placement.SHARD_ROWS: dtensor.Shard(0),
                Placement.SHARD_LAST: dtensor.Shard(-1), Placement.PARTIAL: dtensor.Partial()}[self]


R, S0, S1, P = Placement.REPLICATE, Placement.SHARD_ROWS, Placement.SHARD_LAST, Placement.PARTIAL
