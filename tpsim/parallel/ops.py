"""The collectives the tracer records, by one name each (the torch.distributed call's, which the
JSON output keeps as its string)."""

from __future__ import annotations

from enum import StrEnum


class Op(StrEnum):
    """A collective as the tracer records it; the value is torch.distributed's function name."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    ALL_GATHER_OBJECT = "all_gather_object"  # check's own bookkeeping (routing rows, the ranks' captures)

    @property
    def short(self) -> str:
        """`AR`, `AG`, ...: as check's table writes the op (its name where it has no short form)."""
        return _SHORT.get(self, self.value)


_SHORT = {Op.ALL_REDUCE: "AR", Op.ALL_GATHER: "AG", Op.REDUCE_SCATTER: "RS", Op.ALL_TO_ALL: "A2A",
          Op.BROADCAST: "BC"}
