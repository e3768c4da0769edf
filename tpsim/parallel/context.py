"""Where attention's keys come from when its queries are not every token of the sequence: the
`Keys` protocol, and its two kinds.

`TokenShards` (context parallelism): rank r of a group holds the contiguous tokens
`offset .. offset + sizes[r]` of one sequence, and attention all-gathers what the KV cache holds
(one all-gather per layer).

`PrefixCache` (SGLang's radix cache): a prefill whose first N tokens hit the cache runs the
target on the T-N suffix tokens only, attending to the prefix's cached KV. The prefix forward
stores each layer's KV (its caller's name the key); a later forward prepends it. Each TP rank
stores the head shard it computed, so reading it is no collective.

Either way a query at global index i sees keys 0..i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tpsim.parallel.group import TPGroup


class Keys(Protocol):
    """What an attention layer asks of the keys its queries see (the layers' `shards` argument)."""

    @property
    def offset(self) -> int:
        """The global index of this forward's first query."""

    @property
    def total(self) -> int:
        """The keys attention sees: every token up to the last query."""

    def gather(self, x: torch.Tensor, caller: str) -> torch.Tensor:
        """The KV rows of this forward's queries `[queries, ...]` → every key's `[total, ...]`."""

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """The query rows of `x` `[total, ...]`."""

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """`[queries, total]` bool: query i (global index offset + i) sees keys 0..offset + i."""


def causal_mask(queries: int, offset: int, total: int, device: torch.device) -> torch.Tensor:
    """`[queries, total]` bool: query i at global index offset + i sees keys 0..offset + i."""
    rows = torch.arange(queries, device=device)[:, None] + offset
    return torch.arange(total, device=device)[None, :] <= rows


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
        return causal_mask(self.sizes[self.group.rank], self.offset, self.total, device)


@dataclass
class PrefixCache:
    """A radix-cache hit of the first `length` tokens of a prompt, on one rank: its first forward
    (the prefix, `length` tokens at positions 0..length-1) stores every layer's KV; each later forward
    (the suffix, at positions length..) attends to the stored KV and its own (module docstring)."""

    length: int
    kv: dict[str, torch.Tensor] = field(default_factory=dict)  # the caller's name -> the prefix's KV rows

    def __post_init__(self):
        if self.length < 1:
            raise ValueError(f"a prefix cache holds at least one token, not {self.length}")

    @property
    def filled(self) -> bool:
        return bool(self.kv)

    def keys(self, queries: int) -> "CachedKeys":
        """The keys of a forward of `queries` tokens: the prefix's own (storing them) while the cache is
        empty, else the stored prefix and the suffix."""
        if not self.filled and queries != self.length:
            raise ValueError(f"the prefix forward runs the {self.length} cached tokens, not {queries}")
        return CachedKeys(self, self.length if self.filled else 0, queries)


@dataclass(frozen=True)
class CachedKeys:
    """One forward's view of a PrefixCache: `queries` tokens from global index `offset` (0: the
    prefix forward, which fills the cache)."""

    cache: PrefixCache
    offset: int
    queries: int

    @property
    def total(self) -> int:
        return self.offset + self.queries

    def gather(self, x: torch.Tensor, caller: str) -> torch.Tensor:
        if self.offset == 0:
            if caller in self.cache.kv:
                raise ValueError(f"{caller} stored its prefix KV twice")
            self.cache.kv[caller] = x
            return x
        return torch.cat([self.cache.kv[caller], x])

    def own(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.offset:]

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        return causal_mask(self.queries, self.offset, self.total, device)
