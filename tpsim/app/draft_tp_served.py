"""The draft under TP for `tpsim draft --server ... --tp N`: one pool of N gloo ranks for every replay of the
command (tpsim.app.draft_tp), its findings and the notes of what the replays showed where nothing is wrong."""

from __future__ import annotations

import torch

from tpsim.app import draft_tp
from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.findings import DraftFinding
from tpsim.profiles.profile import Platform
from tpsim.parallel.torchrun import under_torchrun
from tpsim.profiles.loaders import ServedLoader


def tp_findings(ckpt: DraftCheckpoint, servers: list[ServedLoader], target: torch.Tensor | None, tp: int,
                platform: Platform | None, notes: list[str]) -> list[DraftFinding]:
    """The findings of every server in `servers` at TP `tp` (none at TP 1); `notes` gets what was replayed clean."""
    if tp == 1:
        return []
    if under_torchrun():  # the ranks are torchrun's: a pool of N more per rank would replay nothing new
        notes.append("the draft under TP is replayed on a self-started pool: run tpsim draft without torchrun")
        return []
    out: list[DraftFinding] = []
    with draft_tp.ranks(tp) as pool:
        for s in servers:
            out += draft_tp.vocab_findings(pool, ckpt, s, platform, notes)
            if ckpt.weights:
                out += draft_tp.embed_verdict(pool, ckpt.tensors.get("embed_tokens.weight"), target, s)
            out += draft_tp.verify_findings(pool, s, platform)
    return out
