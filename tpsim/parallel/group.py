"""The TP group object every layer receives, and its traced collectives.

Layers communicate only through these wrappers, so the trace says exactly which
collectives ran, from which module, with what shape, dtype and bytes. At size 1 no
collective runs (engines skip them too) and nothing is recorded.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tpsim.base import faults
from tpsim.parallel.ops import Op


@dataclass
class CollectiveRecord:
    op: Op
    caller: str  # the calling module's name, e.g. "model.layers.3.self_attn.o_proj"
    shape: tuple
    dtype: str
    bytes: int  # bytes of this rank's input tensor
    span: tuple | None = None  # (start, end): CUDA events or perf_counter stamps, when the tracer is timed

    def seconds(self) -> float | None:
        """How long this rank's stream waited for the collective, a slower peer included (on CUDA
        only after a synchronize); None when it was not timed."""
        if self.span is None:
            return None
        start, end = self.span
        return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


@dataclass
class Tracer:
    records: list[CollectiveRecord] = field(default_factory=list)
    timed: bool = False  # stamp each all-reduce (benchmarks/forward_tp.py); off, nothing is stamped

    def record(self, op: Op, caller: str, t: torch.Tensor) -> CollectiveRecord:
        rec = CollectiveRecord(op, caller, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                               t.numel() * t.element_size())
        self.records.append(rec)
        return rec

    def stamp(self, device: torch.device):
        """A CUDA event recorded on the current stream, or perf_counter() on the CPU (None untimed)."""
        if not self.timed:
            return None
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def count(self, op: Op) -> int:
        return sum(r.op == op for r in self.records)

    def clear(self) -> None:
        self.records.clear()


def _code(text: str) -> int:
    """A stable 62-bit code of a string (Python's hash() differs between processes)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


LOADING_TIMEOUT_S = 1800.0  # how long a rank waits for its group's weights (wait_loaded)


@dataclass
class TPGroup:
    """One tensor-parallel group, seen from one of its ranks.

    rank/size: position in the group. pg: the torch process group (None when size == 1).
    ranks: the global ranks of the members. device: where this rank's tensors live.
    """

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None
    ranks: tuple[int, ...] = (0,)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tracer: Tracer = field(default_factory=Tracer)
    verify: bool = False  # check op, caller, dtype and shape across the group before each collective
    loading_pg: dist.ProcessGroup | None = None  # gloo: the same ranks with LOADING_TIMEOUT_S, for wait_loaded
    timeout_s: float = 60.0  # how long a point-to-point send or recv waits for its peer
    p2p_pg: dist.ProcessGroup | None = None  # PP: this rank and its peers on the other stages (None: the world)

    def local_view(self) -> "TPGroup":
        """A size-1 group of this rank alone, sharing this group's tracer: for layers that are
        replicated (not split) inside a bigger group, as dp-attention's attention."""
        return TPGroup(rank=0, size=1, ranks=(self.ranks[self.rank],), device=self.device, tracer=self.tracer,
                       timeout_s=self.timeout_s)

    def wait_loaded(self) -> None:
        """Wait until every rank of the group holds its weights. Seeding or reading a full-size
        model takes minutes on a busy CPU (rank 0 also builds the TP=1 reference first), longer
        than one collective's timeout, which a rank that finished early would otherwise spend in
        its first all-reduce. gloo only: NCCL ranks load on their GPUs in seconds."""
        if self.loading_pg is None:
            return
        faults.doing(f"waiting for the weights of the TP={self.size} group of ranks {list(self.ranks)}")
        dist.barrier(group=self.loading_pg)

    def _enter(self, op: Op, caller: str, x: torch.Tensor) -> None:
        faults.doing(f"{op} in {caller} (TP={self.size} group of ranks {list(self.ranks)})")
        faults.at(caller, self.ranks[self.rank])
        if self.verify:
            self._verify(op, caller, x)

    def _verify(self, op: Op, caller: str, x: torch.Tensor) -> None:
        """Compare (op, caller, dtype, shape) across the group with one small all-gather first:
        gloo aborts the process on a size mismatch, and an equal-size mismatch would
        silently reduce the wrong tensors. all_to_all rows may differ (uneven splits)."""
        shape = list(x.shape[1:] if op is Op.ALL_TO_ALL else x.shape)
        sig = [_code(op), _code(caller), _code(str(x.dtype)), len(shape), *shape][:16]
        mine = torch.tensor(sig + [-1] * (16 - len(sig)), dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=self.pg)
        if any(not torch.equal(e, mine) for e in every):
            others = []
            for i, e in enumerate(every):
                if not torch.equal(e, mine):
                    what = [w for w, j in (("another collective", 0), ("another caller", 1), ("another dtype", 2))
                            if e[j] != mine[j]]
                    others.append(f"rank {self.ranks[i]} {', '.join(what + [f'shape {e[4:4 + e[3]].tolist()}'])}")
            raise RuntimeError(f"collective mismatch in {op} at {caller}: rank {self.ranks[self.rank]} has "
                               f"{str(x.dtype).removeprefix('torch.')} {shape}; " + "; ".join(others))

    def all_reduce(self, x: torch.Tensor, caller: str) -> torch.Tensor:
        """Sum of `x` over the group, replicated on every rank (same shape as x)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self._enter(Op.ALL_REDUCE, caller, x)
        rec, start = self.tracer.record(Op.ALL_REDUCE, caller, x), self.tracer.stamp(self.device)
        dist.all_reduce(x, group=self.pg)
        if start is not None:
            rec.span = (start, self.tracer.stamp(self.device))
        return x

    def all_gather(self, x: torch.Tensor, caller: str, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self._enter(Op.ALL_GATHER, caller, x)
        self.tracer.record(Op.ALL_GATHER, caller, x)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.pg)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, caller: str, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then this rank's contiguous 1/size slice along `dim`."""
        if self.size == 1:
            return x
        self._enter(Op.REDUCE_SCATTER, caller, x)
        self.tracer.record(Op.REDUCE_SCATTER, caller, x)
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
        out = torch.empty_like(chunks[self.rank])
        dist.reduce_scatter(out, chunks, group=self.pg)
        return out

    def gather_rows(self, x: torch.Tensor, sizes: list[int], caller: str) -> torch.Tensor:
        """Every rank's rows `[sizes[r], ...]` concatenated in rank order `[sum(sizes), ...]`:
        one all-gather of the rows padded to max(sizes) (collectives need equal sizes)."""
        if self.size == 1:
            return x
        n = max(sizes)
        padded = torch.cat([x, x.new_zeros((n - x.shape[0], *x.shape[1:]))]) if x.shape[0] < n else x
        every = self.all_gather(padded, caller, dim=0)
        return torch.cat([every[r * n:r * n + s] for r, s in enumerate(sizes)])

    def gather_rows_by_sum(self, x: torch.Tensor, sizes: list[int], caller: str,
                           placed: list[int] | None = None) -> torch.Tensor:
        """As gather_rows, by one all-reduce instead: a zero `[sum(sizes), ...]` buffer in which this
        rank writes its rows at its offset, summed over the group (SGLang's `_dp_gather_via_all_reduce`,
        dp-attention's SUM_LEN padding). Exact: every other rank adds zeros to each row. `placed`: the
        rows each rank writes when that count is not its row count (SGLang's `dp_local_num_tokens`):
        rank r its first placed[r] rows at offset sum(placed[:r]); the buffer stays sum(sizes) rows."""
        if self.size == 1:
            return x
        placed = sizes if placed is None else placed
        start, n = sum(placed[:self.rank]), min(placed[self.rank], x.shape[0])
        buffer = x.new_zeros((sum(sizes), *x.shape[1:]))
        buffer[start:start + n] = x[:n]
        return self.all_reduce(buffer, caller)

    def scatter_rows(self, x: torch.Tensor, sizes: list[int], caller: str) -> torch.Tensor:
        """Sum of `x` `[sum(sizes), ...]` over the group, this rank's rows `[sizes[rank], ...]`
        only: one reduce-scatter of the rows padded to max(sizes) per rank."""
        if self.size == 1:
            return x
        n = max(sizes)
        if any(s != n for s in sizes):
            blocks, start = [], 0
            for s in sizes:
                blocks += [x[start:start + s], x.new_zeros((n - s, *x.shape[1:]))]
                start += s
            x = torch.cat(blocks)
        return self.reduce_scatter(x, caller, dim=0)[:sizes[self.rank]]

    def all_to_all(self, x: torch.Tensor, caller: str, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> torch.Tensor:
        """`all_to_all_single` along dim 0 with optional uneven splits."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self._enter(Op.ALL_TO_ALL, caller, x)
        self.tracer.record(Op.ALL_TO_ALL, caller, x)
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=self.pg)
        return out

    def broadcast(self, x: torch.Tensor, caller: str, src: int = 0) -> torch.Tensor:
        """Group rank `src`'s `x` on every rank (in place)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self._enter(Op.BROADCAST, caller, x)
        self.tracer.record(Op.BROADCAST, caller, x)
        dist.broadcast(x, src=self.ranks[src], group=self.pg)
        return x

    def all_gather_object(self, obj, caller: str) -> list:
        """Every rank's picklable `obj`, in rank order (check's bookkeeping: the routing rows of the
        ranks' token shares, the ranks' captures for a diagnosis). Traced with no shape or bytes: what
        travels is a pickle, not a tensor."""
        if self.size == 1:
            return [obj]
        self._enter(Op.ALL_GATHER_OBJECT, caller, torch.empty(0, device=self.device))
        self.tracer.records.append(CollectiveRecord(Op.ALL_GATHER_OBJECT, caller, (), "object", 0))
        every = [None] * self.size
        dist.all_gather_object(every, obj, group=self.pg)
        return every

    # --- point to point (pipeline parallelism): between this rank and one rank of another group ---

    def send(self, x: torch.Tensor, dst: int, caller: str) -> None:
        """Send `x` to global rank `dst` (its `recv` must ask for the same shape and dtype), waiting
        at most `timeout_s` for it to go. Recorded at every group size: the peer is outside the group."""
        x = x.contiguous()
        self._enter_p2p(Op.SEND, caller, dst)
        self.tracer.record(Op.SEND, caller, x)
        dist.isend(self._wire(x), dst=dst, group=self.p2p_pg).wait(timedelta(seconds=self.timeout_s))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, caller: str) -> torch.Tensor:
        """A tensor of `shape` and `dtype` from global rank `src`, waiting at most `timeout_s`."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self._enter_p2p(Op.RECV, caller, src)
        self.tracer.record(Op.RECV, caller, x)
        wire = self._wire(x)
        dist.irecv(wire, src=src, group=self.p2p_pg).wait(timedelta(seconds=self.timeout_s))
        return wire.to(self.device)

    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as the point-to-point backend carries it: gloo sends and receives host memory only (a CUDA
        tensor fails in its TCP transport), NCCL device memory."""
        if x.is_cuda and dist.get_backend(self.p2p_pg) == "gloo":
            return x.cpu()
        return x

    def _enter_p2p(self, op: Op, caller: str, peer: int) -> None:
        me = self.ranks[self.rank]
        faults.doing(f"{op} in {caller} (rank {me} {'to' if op is Op.SEND else 'from'} rank {peer})")
        faults.at(caller, me)
