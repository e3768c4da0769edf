"""The draft under TP on real ranks (tpsim.profiles.draft_tp says what each engine does): the draft's lm_head split
over the vocabulary as the engine pads it, each rank's embed_tokens verdict on its own shard and the draft it then
builds, and SGLang's greedy verify where each rank accepts its own count. Jobs run on every rank of the pool; a rank
outside the first `tp` returns None."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpsim.parallel.group import TPGroup
from tpsim.parallel.launch import RankContext


def _shard(full: torch.Tensor, rows: int, group: TPGroup) -> torch.Tensor:
    """This rank's contiguous slice of `full` padded with zero rows to `rows` (vocab_parallel_embedding.py: padding
    rows sit at the end of the last rank(s), zero-filled by the weight loader)."""
    per = rows // group.size
    start = group.rank * per
    out = torch.zeros(per, full.shape[1], dtype=full.dtype)
    real = max(0, min(start + per, full.shape[0]) - start)
    out[:real] = full[start:start + real]
    return out


def sharded_head(ctx: RankContext, tp: int, weight: torch.Tensor, rows: int, hidden: torch.Tensor):
    """The draft's logits `[T, Vd]`: this rank's `rows / tp` vocabulary rows applied to `hidden`, all-gathered along
    the vocabulary and sliced to Vd (ParallelLMHead, then the logits processor's gather)."""
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    local = F.linear(hidden, _shard(weight, rows, group))
    return group.all_gather(local, "draft.lm_head", dim=-1)[..., : weight.shape[0]]


def embed_verdicts(ctx: RankContext, tp: int, target: torch.Tensor, draft: torch.Tensor, ids: torch.Tensor,
                   unanimous: bool):
    """{verdict, unanimous, embeds}: this rank's torch.equal of its shard of the target's embed_tokens against its
    shard of the draft's (vLLM's _maybe_share_embeddings), `unanimous`: the MIN over the group first (PR #50280);
    `embeds`: the lookup of `ids` by the module the rank's draft then holds (the target's shard when it shares)."""
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    rows = -(-target.shape[0] // 64) * 64
    mine, theirs = _shard(target, rows, group), _shard(draft, rows, group)
    verdict = torch.equal(mine, theirs)
    agreed = verdict
    if unanimous:
        every = group.all_gather(torch.tensor([int(verdict)]), "draft.embed_verdict", dim=0)
        agreed = bool(every.min())
    table = mine if agreed else theirs
    per = rows // group.size
    outside = (ids < group.rank * per) | (ids >= (group.rank + 1) * per)
    part = F.embedding(torch.where(outside, 0, ids - group.rank * per), table)
    part.masked_fill_(outside.unsqueeze(-1), 0)
    embeds = group.all_reduce(part, "draft.embed_tokens")
    return {"verdict": verdict, "shares": agreed, "embeds": embeds}


def rank_order_sum(parts: torch.Tensor, rank: int) -> torch.Tensor:
    """The TP partial sums `[tp, ...]` added in rank `rank`'s order (its own first, then the next ranks), rounding
    after each add in the parts' dtype: what a one-shot all-reduce that starts at the local buffer computes."""
    tp = parts.shape[0]
    out = parts[rank].clone()
    for i in range(1, tp):
        out = out + parts[(rank + i) % tp]
    return out


def accepted(drafts: torch.Tensor, predict: torch.Tensor) -> int:
    """Greedy chain verify (verify_tree_greedy_func at topk 1): the leading drafts the target's argmax agrees with."""
    n = 0
    while n < drafts.numel() and int(drafts[n]) == int(predict[n]):
        n += 1
    return n


def greedy_verify(ctx: RankContext, tp: int, partials: torch.Tensor, lm_head: torch.Tensor, drafts: torch.Tensor,
                  broadcast: bool):
    """{count, counts, predict}: this rank's final hidden is its own sum of the row-parallel partials `[tp, k+1, H]`
    (all-gathered first: the one-shot all-reduce's exchange), its target logits the lm_head's, its predictions their
    argmax and `count` the drafts it accepts; with `broadcast` rank 0's decision overwrites every rank's (sglang
    PR #31478). `counts` is every rank's count, gathered with the group's timeout before any collective whose shapes
    depend on the counts (where the engine would deadlock)."""
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    every = group.all_gather(partials[group.rank].unsqueeze(0), "verify.one_shot_all_reduce", dim=0)
    hidden = rank_order_sum(every, group.rank).float()
    predict = torch.argmax(F.linear(hidden, lm_head), dim=-1)
    count = accepted(drafts, predict)
    if broadcast:
        decision = group.broadcast(torch.cat([torch.tensor([count]), predict]), "verify.broadcast", src=0)
        count, predict = int(decision[0]), decision[1:]
    counts = group.all_gather_object(count, "verify.accepted_counts")
    return {"count": count, "counts": counts, "predict": predict.tolist()}
