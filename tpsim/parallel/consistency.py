"""Cross-rank consistency: before the first forward, every rank hashes what it is about to
run (config, weights seed or checkpoint fingerprint, input ids, dtype, capture spec) and
the ranks compare. Under torchrun each rank parses its own arguments and reads its own
files, so a rank started differently, or reading a different checkpoint, is an error naming
the field and the ranks on each side, not a silent wrong answer or a mismatched collective."""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from tpsim.base.errors import UsageError


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def agree(world_size: int, fields: dict[str, object]) -> None:
    """Raise UsageError on every rank if any field differs between ranks (one all_gather)."""
    if world_size == 1:
        return
    mine = {k: digest(v) for k, v in fields.items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for k in fields:
        by_value: dict[str, list[int]] = {}
        for r, theirs in enumerate(everyone):
            by_value.setdefault(theirs.get(k), []).append(r)
        if len(by_value) > 1:
            sides = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {spans(rs)} {v}"
                              for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0]))
            raise UsageError(f"the ranks disagree on {k} ({sides}); start every rank with the same arguments "
                             "and the same files")
