"""The rank side of `tpsim acceptance`: the target's greedy answers (generated where none are given) and, per
sequence, the capture the draft is fed on group rank 0 with the greedy tokens the target verifies with."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tpsim.model.decoder import CausalLM
from tpsim.parallel.launch import RankContext
from tpsim.run.jobs import _compare_ranks, _progress, agree_on_run, own_tokens, run_captured_parts, spec_model
from tpsim.run.spec import RunSpec


@dataclass(frozen=True)
class SequenceCapture:
    """One sequence as group rank 0 holds it: its capture `[rows, W]` (rank 0's own tensor, whatever the other
    ranks hold: the draft beside rank 0 reads this one), whether every rank held the same tensor (or its own
    tokens, under dp-attention), and the
    target's greedy token after each position (`argmax[t]`: after reading tokens 0..t)."""

    capture: torch.Tensor
    identical: bool
    argmax: list[int]


def greedy(model: CausalLM, prompt: list[int], new_tokens: int, stop: int | None) -> list[int]:
    """The prompt and the target's greedy answer (`new_tokens` at most, up to `stop`): a full forward per
    token, no KV cache (tpsim's decoder has none; prompts given as text are answered once, then cached)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(torch.tensor(ids, dtype=torch.long, device=model.group.device))[-1].argmax())
            ids.append(nxt)
            if nxt == stop:
                break
    return ids


def answers_job(ctx: RankContext, spec: RunSpec, prompts: list[list[int]], new_tokens: int,
                stop: int | None) -> list[list[int]] | None:
    """At TP 1 on rank 0: each prompt followed by the target's greedy answer."""
    agree_on_run(ctx, spec, {"answers": len(prompts), "new_tokens": new_tokens})
    if not ctx.participates(1):
        return None
    model = spec_model(spec, ctx.groups[1], _progress(ctx, 1))
    out = []
    for i, p in enumerate(prompts):
        ctx.progress(f"answering prompt {i + 1}/{len(prompts)} greedily ({new_tokens} tokens at most)")
        out.append(greedy(model, p, new_tokens, stop))
    return out


def captures_job(ctx: RankContext, spec: RunSpec, tp: int, sequences: list[list[int]]) -> list[SequenceCapture] | None:
    """At TP=tp in the spec's mode, for each sequence: group rank 0's capture with the spec's strategy and the
    target's greedy tokens (None on the other ranks)."""
    got = captures_many_job(ctx, spec, tp, sequences, [spec])
    return None if got is None else got[0]


def captures_many_job(ctx: RankContext, spec: RunSpec, tp: int, sequences: list[list[int]],
                      specs: list[RunSpec]) -> list[list[SequenceCapture]] | None:
    """captures_job for several specs at one TP (a sweep's configurations; `spec`: the one the pool was started
    for, among them), in one pool: one model per spec that differs from another only in what it captures, and one
    forward per sequence for all the positions of the specs that share a model and a capture strategy (each
    spec's capture is its own positions' parts of it)."""
    agree_on_run(ctx, spec, {"positions": [[str(p) for p in s.positions] for s in specs], "tp": tp,
                                 "sequences": len(sequences), "strategy": [s.strategy.value for s in specs]})
    if not ctx.participates(tp):
        return None
    group = ctx.groups[tp]
    out: list[list[SequenceCapture]] = [[] for _ in specs]
    for members in _sharing(specs):
        spec = specs[members[0]]
        union = list(dict.fromkeys(p for m in members for p in specs[m].positions))
        model = spec_model(spec, group, _progress(ctx, tp), spec.mode)
        with torch.no_grad():
            for i, seq in enumerate(sequences):
                ctx.progress(f"TP={tp}: sequence {i + 1}/{len(sequences)}")
                parts, logits = run_captured_parts(model, own_tokens(seq, spec.mode, group), union, spec.strategy)
                argmax = logits.argmax(-1).tolist()
                for m in members:
                    own = [parts[union.index(p)] for p in specs[m].positions]
                    identical, _ = _compare_ranks(group, own, spec.mode, None, list(specs[m].positions))
                    out[m].append(SequenceCapture(torch.cat(own, dim=-1).cpu(), identical is not False, argmax))
    return out if group.rank == 0 else None


def _sharing(specs: list[RunSpec]) -> list[list[int]]:
    """The specs' indices grouped by what one forward serves: the same spec but for its positions (compared, not
    hashed: a config's dict fields do not hash)."""
    groups: list[tuple[RunSpec, list[int]]] = []
    for i, s in enumerate(specs):
        key = replace(s, positions=())
        at = next((members for k, members in groups if k == key), None)
        if at is None:
            groups.append((key, [i]))
        else:
            at.append(i)
    return [members for _, members in groups]
