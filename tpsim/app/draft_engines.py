"""`tpsim draft` past the loader: the config key each engine version reads the capture ids from
(tpsim/profiles/draft.py), and, with no --server, every profiled release of every engine at once: each defect any of
them acts on, one finding per engine naming the releases that act on it."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from tpsim.app.draft_served import SUPERSEDED, served_findings
from tpsim.base.errors import UsageError
from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.findings import DraftDefect, DraftFinding
from tpsim.profiles import registry
from tpsim.profiles.draft import read_ids, write_ids, write_ids_hint
from tpsim.offline.sides import ids_capturing
from tpsim.profiles.loader_lines import LINES, lookup
from tpsim.profiles.loaders import ServedLoader
from tpsim.profiles.replay import replay

TRAINER = "specforge"  # who wrote the ids: triage's default --train


def ids_findings(ckpt: DraftCheckpoint, servers: list[ServedLoader], model_type: str,
                 layers: int | None = None) -> list[DraftFinding]:
    """Where the config's layer ids sit against the keys each server reads: ids at a key it never reads (it captures
    its default layers; with the target's `layers`, a default that lands where the ids would is a warning) or a
    value it fails on."""
    out = []
    for s in servers:
        try:
            profile = registry.lookup(s.name, model_type)
        except UsageError:
            continue  # a release whose capture tpsim did not read: the loader's UNVERIFIED findings say so
        got, source = read_ids(profile, ckpt.raw), str(profile.behaviour.config.source)
        keys = profile.behaviour.config.value.keys
        if got.fallback is not None and keys:
            meant = None if layers is None else _trainer_captures(ckpt.raw, model_type, layers)
            lucky = meant is not None and _default(profile, layers) == meant
            fix = (meant and _safeguard(profile, ckpt.raw, meant, layers)) or \
                f"write the ids at {keys[0]} too (the key {s.name} reads first)"
            out.append(DraftFinding(
                DraftDefect.IDS_LUCKY if lucky else DraftDefect.IDS_UNREAD,
                f"{got.fallback}: it captures its default layers" + (
                    ", which for this target's layers are the ones the ids name: this works by coincidence (another "
                    "engine version or layer count breaks it)" if lucky else ", not the ones the draft names" +
                    ("" if layers is not None else " (whether they coincide depends on the target: give --model)")),
                source, fix, ".".join(keys[0].path), s.name))
        elif got.ids is not None and layers is not None:
            out += _misread(ckpt.raw, s.name, profile, got, model_type, layers)
        elif got.failure is not None and not got.off:
            out.append(DraftFinding(DraftDefect.IDS_UNREAD, got.failure, source, got.failure.rpartition("; ")[2],
                                    str(got.key), s.name))
    return out


def _misread(raw: dict, name: str, profile, got, model_type: str, layers: int) -> list[DraftFinding]:
    """The ids `profile` reads, replayed on the target's layers, against what the trainer captured from them."""
    meant = _trainer_captures(raw, model_type, layers)
    if meant is None:
        return _unfit(raw, name, profile, got, model_type, layers)
    try:
        served = replay(profile, got.ids, layers)
    except UsageError as e:
        served = None
        failure = str(e)
    else:
        failure = served.failure
    if failure is None and list(served.positions) == meant:
        return []
    what = f"fails ({failure})" if failure else f"captures {', '.join(map(str, served.positions))}"
    fix = _safeguard(profile, raw, meant, layers) or "write ids that capture the trained layers where the server " \
                                                      "reads them (tpsim triage names them)"
    return [DraftFinding(DraftDefect.IDS_MISREAD,
                         f"{name} reads {got.ids} at {got.where} ({profile.name}) and {what}; {TRAINER}, which wrote "
                         f"them, captures {', '.join(map(str, meant))}: the draft is fed other layers than it was "
                         "trained on", str(profile.behaviour.numbering.source), fix, got.where, name)]


def _unfit(raw: dict, name: str, profile, got, model_type: str, layers: int) -> list[DraftFinding]:
    """Ids the trainer itself fails on with this target (one past its last layer, say): the draft was trained for
    another target, or its ids were edited; whatever `profile` captures from them is not what training saw."""
    trained = _trainer_replay(raw, model_type, layers)
    if trained is None or trained.failure is None:
        return []
    return [DraftFinding(DraftDefect.IDS_MISREAD,
                         f"{name} reads {got.ids} at {got.where} ({profile.name}), and {TRAINER}, which wrote them, "
                         f"fails on them with this target's {layers} layers: {trained.failure}; the draft was not "
                         "trained with these ids on this target", str(trained.profile.behaviour.out_of_range.source),
                         f"give --model the target the draft was trained for, or write ids {TRAINER} captures from "
                         f"{layers} layers where {name} reads them", got.where, name)]


def _trainer_replay(raw: dict, model_type: str, layers: int):
    """The trainer's (SpecForge, triage's default --train) replay of this config's ids (None: no trainer profile)."""
    try:
        trainer = registry.lookup(TRAINER, model_type)
        return replay(trainer, read_ids(trainer, raw).ids, layers)
    except UsageError:
        return None


def _trainer_captures(raw: dict, model_type: str, layers: int) -> list | None:
    """What the trainer captures from this config (None: it cannot)."""
    got = _trainer_replay(raw, model_type, layers)
    return None if got is None or got.failure else list(got.positions)


def _default(profile, layers: int) -> list | None:
    try:
        got = replay(profile, None, layers)
    except UsageError:
        return None
    return None if got.failure else list(got.positions)


def _safeguard(profile, raw: dict, meant: list, layers: int) -> str | None:
    """The ids `profile` must read to capture `meant`, written where it reads first: replayed on the config as
    changed (None: no ids do, or the change does not read back)."""
    ids = ids_capturing(profile, meant, layers)
    if ids is None:
        return None
    changed = json.loads(json.dumps(raw))
    write_ids(changed, profile, ids)
    got = read_ids(profile, changed)
    if got.ids is None or replay(profile, got.ids, layers).positions != meant:
        return None
    return write_ids_hint(profile, ids) + f" (captures {', '.join(map(str, meant))}; replayed)"


def releases(engine: str) -> list[str]:
    """The engine's releases whose draft loader tpsim read, oldest first."""
    line, key = LINES[engine], registry.version_key
    return sorted((r for r in registry.RELEASES[engine] if key(line.oldest) <= key(r) <= key(line.newest)), key=key)


def every_release(ckpt: DraftCheckpoint, layout: list[DraftFinding], target_embed: torch.Tensor | None, tp: int,
                  model_type: str, layers: int | None) -> list[DraftFinding]:
    """`layout` (inspect's findings) with what every profiled release does with this draft: one finding per defect
    and engine, its `server` the release ranges that act on it (the layout's embed-absent stays where no target
    says which embedding the engines would use)."""
    kept = [f for f in layout if f.defect not in SUPERSEDED
            or (f.defect is DraftDefect.EMBED_ABSENT and target_embed is None)]
    out = []
    for engine in LINES:
        rels = releases(engine)
        hits: dict[tuple, list[tuple[int, DraftFinding]]] = {}
        for i, r in enumerate(rels):
            s = lookup(f"{engine}@{r}")
            for f in served_findings(ckpt, [], [s], target_embed, tp) + ids_findings(ckpt, [s], model_type, layers):
                hits.setdefault((f.defect, f.key), []).append((i, f))
        out += [replace(found[-1][1], server=_ranges(engine, rels, [i for i, _ in found])) for found in hits.values()]
    return kept + out


def _ranges(engine: str, rels: list[str], hit: list[int]) -> str:
    """`vllm 0.11.0 to 0.17.1, 0.30.0` from the indices into `rels` that act."""
    runs: list[list[int]] = []
    for i in hit:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return f"{engine} " + ", ".join(rels[r[0]] if len(r) == 1 else f"{rels[r[0]]} to {rels[r[-1]]}" for r in runs)
