"""Where one forward's activations live, stage by stage, and the one transition that moves them.

A mode declares a `Plan` (SGLang's `LayerScatterModes`): the placement of every stage of every
decoder layer, and of the embedding and the final norm. `Stream.move` takes a tensor from one
placement to another with the collective that needs:

| from → to                   | what runs                                                     |
|-----------------------------|---------------------------------------------------------------|
| Partial(sum) → Replicate()  | all-reduce                                                    |
| Partial(sum) → Shard(dim=0) | reduce-scatter of rows: this rank keeps its `sizes[rank]` rows (`by_sum`: all-reduce, then this rank's rows) |
| Shard(dim=0) → Replicate()  | all-gather of rows (`by_sum`: all-reduce of a zero buffer holding each rank's rows at its offset) |
| Replicate() → Shard(dim=0)  | nothing: this rank takes its rows                             |
| p → p                       | nothing (Partial → Partial: a deferred all-reduce stays pending) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.layers.probe import Rows
from tpsim.parallel.context import TokenShards
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S0, Placement


def split_sizes(T: int, n: int) -> list[int]:
    """Contiguous split of T rows over n ranks, the first T % n one row longer."""
    return [T // n + (r < T % n) for r in range(n)]


@dataclass(frozen=True)
class Stages:
    """The placements of one decoder layer's tensors on this rank, stage by stage. A sublayer's
    output is declared as computed: Partial(sum) from weights split over the ranks (heads,
    intermediate columns), Shard(dim=0) from weights whole on the rank applied to its own rows
    (dp-attention's attention, ep's experts)."""

    layer_input: Placement   # hidden + residual entering; Partial(sum): the previous MLP's all-reduce, deferred here
    attn_input: Placement    # what attention reads
    attn_output: Placement   # attention's output as computed
    middle: Placement        # the residual stream through both norms
    mlp_input: Placement     # what the MLP/MoE reads
    mlp_output: Placement    # the MLP/MoE output as computed
    layer_output: Placement  # hidden + residual leaving; Partial(sum): this layer's MLP all-reduce is deferred
    attn_reduce_in_norm: bool = False  # the attention all-reduce runs fused in post_attention_layernorm (same sum)

    @property
    def residual_output(self) -> Placement:
        """The residual leaving the layer: a deferred all-reduce leaves it where it was (only
        hidden is a partial sum)."""
        return self.middle if self.layer_output is P else self.layer_output


@dataclass(frozen=True)
class Plan:
    """The stages of one forward: the embedding lookup as computed, every decoder layer, and
    where the final norm's output goes (position `final`, the head's input); under two-batch
    overlap, the first layer run as two micro-batches (tpsim.modes.tbo)."""

    embed: Placement
    layers: tuple[Stages, ...]
    final: Placement
    tbo_from: int | None = None  # two-batch overlap: layers from this one on run as two micro-batches

    @property
    def start(self) -> Placement:
        """The stream after the embedding: layer 0's input."""
        return self.layers[0].layer_input


@dataclass(frozen=True)
class Stream:
    """One forward's tokens over the group: `total` tokens; Shard(dim=0) puts `sizes[r]` rows on
    rank r, the first `real` of this rank's rows real tokens. `length`: the rows the model runs
    when the mode pads the batch (sp), else None. `shared`: Shard(dim=0) rows are shares of one
    batch (False under dp-attention, where a rank's rows are its own whole batch). `by_sum`: rows move
    between Shard(dim=0) and the whole batch by all-reduces of a `[sum(sizes), ...]` buffer instead of
    an all-gather / reduce-scatter of rows padded to max(sizes) (dp-attention's SUM_LEN padding). `placed`:
    with `by_sum`, the rows of each rank the MLP's gather places and hands back when that is fewer than
    its rows (dp-attention's `dp_local_num_tokens` taken from the wrong count; tpsim.modes.DpLocalTokens);
    None: all of them. `shards`: context parallelism, the token split attention gathers its keys and
    values over."""

    group: TPGroup
    total: int
    sizes: tuple[int, ...]
    real: int
    length: int | None = None
    shared: bool = True
    by_sum: bool = False
    placed: tuple[int, ...] | None = None
    shards: TokenShards | None = None
    _rows: dict[bool, Rows] = field(init=False, repr=False, compare=False)

    def __post_init__(self):  # the two answers of `rows`, made once per forward rather than at every layer
        whole, split = Rows(self.group, self.total), Rows(self.group, self.total, tuple(self.sizes), self.real)
        object.__setattr__(self, "_rows", {False: whole, True: split if self.shared else whole})

    def move(self, x: torch.Tensor, src: Placement, dst: Placement, *, reduce: str | None = None,
             gather: str | None = None) -> torch.Tensor:
        """`x` held as `src` → as `dst` (module docstring); `reduce` / `gather` name the caller of
        the reduction or the gather this stage may run."""
        if src is dst:
            return x
        g, sizes = self.group, list(self.sizes)
        if src is P and reduce is not None and dst is R:
            return g.all_reduce(x, reduce)
        if src is P and reduce is not None and dst is S0:
            return self.handed_back(g.all_reduce(x, reduce)) if self.by_sum else g.scatter_rows(x, sizes, reduce)
        if src is S0 and dst is R and gather is not None:
            if self.placed is not None:
                return g.gather_rows_by_sum(x, sizes, gather, placed=list(self.placed))
            return self.gather(x, gather)
        if src is R and dst is S0:
            return self.own_rows(x)
        raise ValueError(f"no transition from {src} to {dst} at this stage (reduce={reduce}, gather={gather})")

    def gather(self, x: torch.Tensor, caller: str, by_sum: bool | None = None) -> torch.Tensor:
        """Every rank's Shard(dim=0) rows, concatenated in rank order, on every rank (`by_sum`: how,
        default this stream's)."""
        by_sum = self.by_sum if by_sum is None else by_sum
        gather = self.group.gather_rows_by_sum if by_sum else self.group.gather_rows
        return gather(x, list(self.sizes), caller)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's `sizes[rank]` rows of a tensor of all ranks' rows in rank order (no collective:
        SGLang's `dp_scatter` is a local copy)."""
        start = sum(self.sizes[:self.group.rank])
        return x[start:start + self.sizes[self.group.rank]]

    def handed_back(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the summed `[sum(sizes), ...]` MLP buffer: its own rows, or with `placed`
        the placed[rank] rows at offset sum(placed[:rank]) followed by zero rows (SGLang's `dp_scatter`
        zero-fills the rank's rows, then copies dp_local_num_tokens rows back)."""
        if self.placed is None:
            return self.own_rows(x)
        r = self.group.rank
        start, n = sum(self.placed[:r]), min(self.placed[r], self.sizes[r])
        out = x.new_zeros((self.sizes[r], *x.shape[1:]))
        out[:n] = x[start:start + n]
        return out

    def rows(self, placement: Placement) -> Rows:
        """Which token rows a residual-stream tensor of this placement holds here."""
        return self._rows[placement is S0]
