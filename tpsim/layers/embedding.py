"""Vocab-parallel embedding and LM head (SGLang/vLLM `vocab_parallel_embedding.py`).

The vocabulary is padded globally to a multiple of 64 and split contiguously, so padding
rows sit at the end of the last rank(s); they are zero-filled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.config.model import VOCAB_PADDING
from tpsim.layers.linear import WeightSpec, _copy, divide
from tpsim.layers.probe import Point, Probe, Tapped
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S1


def pad_vocab_size(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(Tapped, nn.Module):
    """ids `[T]` (Replicate()) → `[T, hidden]` Replicate(), after one all-reduce of the
    per-rank partial lookups (rows of other ranks' ids are zero)."""

    POINTS = (Point("partial", P, "this rank's vocab rows looked up (zeros elsewhere), before the all-reduce"),
              Point("out", R, "embedding output = position embed"))

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup, prefix: str, dtype: torch.dtype,
                 probe: Probe | None = None):
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.group, self.prefix, self.point, self.probe = group, prefix, "embed", probe or Probe(group)
        self.padded = pad_vocab_size(vocab_size)
        self.per_rank = divide(self.padded, group.size, "padded vocab size")
        self.start = group.rank * self.per_rank
        self.end = self.start + self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size, dtype=dtype, device=group.device),
                                   requires_grad=False)

    def weight_specs(self):
        def load(t):
            real = max(0, min(self.end, self.vocab_size) - self.start)
            with torch.no_grad():
                self.weight.zero_()
            if real:  # a rank may hold only padding rows
                _copy(self.weight[:real], t[self.start:self.start + real])
        yield WeightSpec(f"{self.prefix}.weight", (self.vocab_size, self.hidden_size), load)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial lookups `[T, hidden]` (Partial(sum)), before any reduction: the
        caller reduces them and taps `out`."""
        if self.group.size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            outside = (input_ids < self.start) | (input_ids >= self.end)
            local = torch.where(outside, 0, input_ids - self.start)
            out = F.embedding(local, self.weight)
            out.masked_fill_(outside.unsqueeze(-1), 0)
        self.tap("partial", out)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.lookup(input_ids), self.prefix)
        self.tap("out", out)
        return out


class ParallelLMHead(VocabParallelEmbedding):
    """final hidden `[T, hidden]` Replicate() → logits `[T, vocab_size]` Replicate(): local
    logits `[T, padded/tp]` (Shard(-1)), all-gathered along vocab, sliced to vocab_size."""

    POINTS = (Point("logits.local", S1, "this rank's slice of the padded vocab logits"),
              Point("logits", R, "all-gathered logits, sliced to vocab_size"))

    def __init__(self, vocab_size, hidden_size, group, prefix, dtype, tie_to: VocabParallelEmbedding | None = None,
                 probe: Probe | None = None):
        super().__init__(vocab_size, hidden_size, group, prefix, dtype, probe)
        if tie_to is not None and tie_to.per_rank == self.per_rank:
            self.weight = tie_to.weight
        elif tie_to is not None:  # a vocab-parallel head tied to a replicated embedding (dp-attention): its rows, shared
            self.weight = nn.Parameter(tie_to.weight.data[self.start:self.end], requires_grad=False)
        self.tied = tie_to is not None
        self.point = ""

    def weight_specs(self):
        return () if self.tied else super().weight_specs()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        self.tap("logits.local", logits)
        logits = self.group.all_gather(logits, self.prefix, dim=-1)[..., : self.vocab_size]
        self.tap("logits", logits)
        return logits
