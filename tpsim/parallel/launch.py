"""What every rank gets, however it started: local ranks the launcher starts itself (tpsim.parallel.pool)
or ranks started by torchrun (tpsim.parallel.torchrun).

Both give every rank a `RankContext` holding one `TPGroup` per TP degree that divides the
world size: with 8 ranks, one TP=8 group, two TP=4, four TP=2 and eight TP=1. Under
torchrun every block runs; in a self-started pool only the first block of each degree
(global ranks 0..tp-1) runs, so 8 CPU ranks on a laptop do not repeat the same work.

A job is a module-level function `fn(ctx, **kwargs)` (pickled by reference, so a moved or
renamed job fails at import, not on the ranks); it runs on every rank and returns something
picklable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpsim.parallel.group import LOADING_TIMEOUT_S, TPGroup


# NVLink multicast (NVLS) stays off in every process tpsim starts: on a shared host a program using
# it can take the GPUs out of service. NCCL reads these when a communicator starts, so setting them
# at import (before any process group; forked ranks inherit them) is early enough.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


@dataclass
class RankContext:
    """What a job sees on one rank: its global rank, its TP groups, its device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    groups: dict[int, TPGroup] = field(default_factory=dict)
    all_blocks: bool = True  # torchrun: every block of every degree runs
    progress_fn: object = None
    _stage_peers: dict = field(default_factory=dict)  # tp -> this rank's pipeline group (pipeline_group)
    _blocks: dict = field(default_factory=dict)  # block sizes -> this rank's group in them (blocks)

    def participates(self, tp: int) -> bool:
        return tp in self.groups and (self.all_blocks or self.rank < tp)

    def pipeline_group(self, tp: int) -> dist.ProcessGroup | None:
        """The process group of this rank and its peers on the other stages (ranks r, r+tp, r+2tp,
        ... of the world), where the stages' send/recv run, apart from the world group's
        collectives (whose sequence numbers TORCH_DISTRIBUTED_DEBUG=DETAIL checks on every rank).
        Collective over the world: every rank calls it, in the same order; made once per degree."""
        if tp not in self._stage_peers:
            mine = None
            if self.world_size // tp > 1:
                timeout = timedelta(seconds=self.groups[tp].timeout_s)
                for r in range(tp):
                    members = list(range(r, self.world_size, tp))
                    pg = dist.new_group(members, timeout=timeout)
                    if self.rank in members:
                        mine = pg
            self._stage_peers[tp] = mine
        return self._stage_peers[tp]

    def blocks(self, sizes: tuple[int, ...]) -> TPGroup | None:
        """This rank's group when ranks 0.. are split into consecutive blocks of `sizes` (PD disaggregation:
        the prefill server's TP group, then the decode server's); None for a rank past them. Their
        send/recv run over the world. Collective over the world: every rank calls it, in the same order;
        made once per `sizes`."""
        if sizes not in self._blocks:
            timeout, mine, start = self.groups[1].timeout_s, None, 0
            # the blocks' send/recv run on a group of their own: on the world they would advance the world's
            # sequence numbers on the sending and receiving ranks only (TORCH_DISTRIBUTED_DEBUG=DETAIL then
            # fails the next world collective, as pipeline_group says)
            p2p = dist.new_group(list(range(sum(sizes))), timeout=timedelta(seconds=timeout))
            for size in sizes:
                members = tuple(range(start, start + size))
                pg = dist.new_group(list(members), timeout=timedelta(seconds=timeout)) if size > 1 else None
                if self.rank in members:
                    mine = TPGroup(rank=self.rank - start, size=size, pg=pg, ranks=members, device=self.device,
                                   verify=verify_collectives(self.device), timeout_s=timeout, p2p_pg=p2p)
                start += size
            self._blocks[sizes] = mine
        return self._blocks[sizes]

    def in_pipeline(self, tp: int, pp: int) -> bool:
        """Whether this rank is one of the pp * tp ranks of a PP x TP world (stage `rank // tp`):
        under torchrun the world must be exactly that; a self-started pool uses its first pp * tp ranks."""
        return tp in self.groups and self.rank < pp * tp and (not self.all_blocks or self.world_size == pp * tp)

    def progress(self, msg: str) -> None:
        if self.rank == 0 and self.progress_fn is not None:
            self.progress_fn(msg)


def build_groups(rank: int, world: int, device: torch.device, timeout_s: float) -> dict[int, TPGroup]:
    """One TPGroup per degree dividing `world`: contiguous blocks of ranks, built in the same
    order on every rank (new_group is collective over the world)."""
    groups = {}
    for tp in range(1, world + 1):
        if world % tp:
            continue
        for start in range(0, world, tp):
            members = tuple(range(start, start + tp))
            pg = loading = None
            if tp > 1:
                pg = dist.new_group(list(members), timeout=timedelta(seconds=timeout_s)) if tp < world \
                    else dist.group.WORLD
                if device.type == "cpu":  # NCCL ranks load on their GPUs in seconds
                    loading = dist.new_group(list(members), timeout=timedelta(seconds=LOADING_TIMEOUT_S),
                                             backend="gloo")
            if rank in members:
                groups[tp] = TPGroup(rank=rank - start, size=tp, pg=pg, ranks=members, device=device,
                                     verify=verify_collectives(device), loading_pg=loading, timeout_s=timeout_s)
    return groups


def verify_collectives(device: torch.device) -> bool:
    """Check every collective's signature across the group first (TPSIM_VERIFY_COLLECTIVES=0/1
    overrides): on by default on CPU, where correctness is the point; off on CUDA, where it
    would cost a small all-gather per collective in the timings."""
    env = os.environ.get("TPSIM_VERIFY_COLLECTIVES")
    return env == "1" if env in ("0", "1") else device.type == "cpu"
