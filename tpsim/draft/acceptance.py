"""Acceptance of greedy chain drafting, exact offline (issue 36): the target's greedy answer is known, so the
capture the engine holds at any verify step is the capture of one teacher-forced forward over prompt + answer
(causal: position t's capture depends on tokens 0..t only), and the draft's KV cache at a round's start holds
step 0 of every accepted position (the engines' extend after verify re-runs step 0 on the target's captures).
So one pass of `Eagle3Draft` over all rows gives every round's chain (`chains`), and `rounds` walks the rounds.

A round at prefix 0..p (token p the target's last sample, its capture not yet known) runs the draft from row
p-1 (capture p-1 with token p), proposes k tokens for p+1..p+k, the target accepts the longest prefix equal
to its own greedy tokens and adds one of its own: p advances accepted + 1. AL = mean(accepted + 1) over rounds,
acceptance at draft position i = the share of rounds that accepted at least i tokens (vLLM's
`num_accepted_tokens_per_pos / num_drafts`, research doc §3.1; EAGLE's τ: "the number of accepted tokens in
each speculative decoding round, add it by 1 ... and average", SafeAILab/EAGLE #195)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpsim.draft.attention import DraftCache
from tpsim.draft.model import Eagle3Draft


def chains(draft: Eagle3Draft, capture: torch.Tensor, tokens: torch.Tensor, k: int,
           stale: tuple[int, int] | None = None, fc: bool = True) -> torch.Tensor:
    """`capture` `[S, W]` and `tokens` `[S]` of one sequence → `[S-1, k]`: row t's greedy chain, the target
    ids the draft proposes for positions t+2 .. t+k+1 when the target has sampled token t+1. `stale` (row r,
    token x): step 0 at row r was run with token x for r+1, not this sequence's (a KV reused from another
    request: tpsim.profiles.prefix); every later row attends to that key and value. `fc` False: the capture is read
    unprojected (`Eagle3Draft.project`)."""
    rows = tokens.shape[0] - 1
    cache, paired = DraftCache(), tokens[1:].clone()
    if stale is not None:
        paired[stale[0]] = stale[1]
    with torch.no_grad():
        step = draft.first(capture[:rows], paired, torch.arange(rows, device=tokens.device), cache, fc)
        out = [draft.proposals(step)]
        for _ in range(k - 1):
            step = draft.next(step, out[-1], cache)
            out.append(draft.proposals(step))
    return torch.stack(out, dim=1)


@dataclass(frozen=True)
class Acceptance:
    """Accepted draft tokens per verify round (0..k each), over one or more sequences; `rows`: per sequence, the
    tokens a round starting at each answer position would accept (every position, not only where rounds fell:
    what two captures are compared on, position by position)."""

    k: int
    accepted: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...] = ()

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def length(self) -> float:
        """AL: tokens per verify round (accepted + the target's own)."""
        return sum(a + 1 for a in self.accepted) / self.rounds if self.rounds else float("nan")

    @property
    def stderr(self) -> float:
        """The standard error of AL (tokens per round, over rounds)."""
        n = self.rounds
        if n < 2:
            return float("nan")
        mean = self.length
        return (sum((a + 1 - mean) ** 2 for a in self.accepted) / (n - 1) / n) ** 0.5

    @property
    def per_position(self) -> list[float]:
        """At draft position i (1..k): the share of rounds that accepted at least i tokens."""
        return [sum(a >= i for a in self.accepted) / self.rounds if self.rounds else float("nan")
                for i in range(1, self.k + 1)]

    def __add__(self, other: "Acceptance") -> "Acceptance":
        if other.k != self.k:
            raise ValueError(f"k {self.k} and {other.k}")
        return Acceptance(self.k, self.accepted + other.accepted, self.rows + other.rows)


def paired(a: Acceptance, b: Acceptance) -> tuple[float, float]:
    """b - a in accepted tokens per round, position by position over the same sequences, and its standard error
    with the sequences as clusters (neighbouring positions share context; sequences do not)."""
    if len(a.rows) != len(b.rows) or any(len(x) != len(y) for x, y in zip(a.rows, b.rows)):
        raise ValueError("paired acceptances must cover the same positions")
    n = sum(len(x) for x in a.rows)
    if n == 0:
        return float("nan"), float("nan")
    sums = [sum(y) - sum(x) for x, y in zip(a.rows, b.rows)]
    mean = sum(sums) / n
    var = sum((s - mean * len(x)) ** 2 for s, x in zip(sums, a.rows)) / n ** 2
    return mean, var ** 0.5


def rounds(proposed: torch.Tensor, tokens: list[int], start: int) -> Acceptance:
    """Walk the verify rounds of one sequence: `proposed` `[S-1, k]` (`chains`), `tokens` the S tokens (prompt
    + the target's greedy answer), `start` the first answer position (the prompt's length: the prefill samples
    token `start`). Rounds run while all k proposals fall inside the sequence."""
    k = proposed.shape[1]
    table = proposed.tolist()

    def at(p: int) -> int:
        a = 0
        while a < k and table[p - 1][a] == tokens[p + 1 + a]:
            a += 1
        return a

    every = tuple(at(p) for p in range(start, len(tokens) - k))
    accepted, p = [], start
    while p + k <= len(tokens) - 1:
        accepted.append(every[p - start])
        p += accepted[-1] + 1
    return Acceptance(k, tuple(accepted), (every,))


def has_round(answer: int, k: int) -> bool:
    """Whether an answer of `answer` tokens gives `rounds` a verify round at k: the first, at the prompt's end p,
    needs its k proposals inside the sequence (p + k <= S - 1), so answer = S - p must exceed k."""
    return answer > k


def greedy_prefix(tokens: list[int], argmax: list[int], start: int) -> int:
    """How many of `tokens` are the target's greedy continuation from `start`: `argmax[t]` is the target's
    greedy token after reading 0..t; the sequence is kept up to the first answer token it disagrees with."""
    for t in range(start, len(tokens)):
        if argmax[t - 1] != tokens[t]:
            return t
    return len(tokens)
