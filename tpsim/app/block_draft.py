"""A DFlash or DSpark draft checked against the engines that serve it (`tpsim draft`, `align`, `triage` hand a
block draft's config here): the taps each engine release takes (tpsim.profiles.block_taps) against the layers the
draft was trained on, each difference a finding whose fix tpsim has replayed (the fixed config, or the other
release, run through the same replay and seen to clear)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from tpsim.draft.findings import TitledFinding
from tpsim.base.errors import UsageError, read_text
from tpsim.capture.positions import Position
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.draft.block import BlockDraft, Family, is_block_draft, read_block_draft
from tpsim.profiles.block_taps import taps
from tpsim.profiles.dflash import SGLANG_READ, Taps, out_of

WIDTH_WORDS = ("DFlash drafter expects", "feature dim mismatch", "fc.weight shape mismatch")  # vLLM's, SGLang's
RUNNER_V2 = "vllm@0.32.0"  # where runner v2 serves (a CUDA GPU with Triton): it extracts a DSpark draft's states


@dataclass
class BlockCheck:
    """A block draft on a target of `L` layers, served by each of `served`; `trained`: the positions it was trained
    on (None: unknown, the config has no ids and no --train gave them)."""

    path: str
    draft: BlockDraft
    L: int
    model_type: str
    trained: tuple[Position, ...] | None
    trained_from: str
    hidden: int | None = None  # the target's hidden size, where known: failures in the engine's numbers
    served: list[Taps] = field(default_factory=list)
    findings: list[TitledFinding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def block_config(text: str | None) -> tuple[dict, str] | None:
    """The parsed config.json at `text` (a file, a directory holding one, a built-in draft's name) when it is a
    DFlash or DSpark draft; None otherwise (the EAGLE-3 path reads it and reports its own errors)."""
    if text is None:
        return None
    p = Path(text)
    builtin = BUILTIN_CONFIGS / "drafts" / f"{text.removesuffix('.json')}.json"
    if not p.exists() and "/" not in text and builtin.is_file():
        p = builtin
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        return None
    try:
        raw = json.loads(read_text(p, "--draft-config", "JSON", "give the draft's config.json"))
    except (ValueError, RecursionError, UsageError):
        return None
    return (raw, str(p)) if is_block_draft(raw) else None


def check(raw: dict, path: str, servers: list[str], L: int, model_type: str,
          trained: tuple[Position, ...] | None, trained_from: str, hidden: int | None = None) -> BlockCheck:
    draft = read_block_draft(raw, path)
    if trained is None and draft.ids is not None:
        trained, trained_from = out_of(draft.ids), f"{draft.ids_key} (output of layer j, as DFlash trains)"
    if trained is not None and len(trained) != draft.taps:
        raise UsageError(f"--train gives {len(trained)} layers but the draft's fc takes {draft.taps} (its "
                         f"{draft.ids_key or 'num_hidden_layers'}); give the {draft.taps} layers it was trained on")
    c = BlockCheck(path, draft, L, model_type, trained, trained_from, hidden)
    for server in servers:
        t = taps(server, draft, raw, L, model_type, hidden)
        c.served.append(t)
        found = finding(c, raw, t)
        if found is not None:
            c.findings.append(found)
        elif t.fallback and trained is None:
            c.warnings.append(f"{server} {t.how}: {list(t.ids or ())}; whether the draft was trained on them is "
                              "unknown (the config names no layers); give --train CONVENTION:IDS to check (tpsim "
                              "align / triage)")
    return c


def finding(c: BlockCheck, raw: dict, t: Taps) -> TitledFinding | None:
    srcs = tuple(cited(s) for s in t.sources)
    if t.nothing:
        return TitledFinding(f"DSpark draft on model runner v1: refused at start-up [{t.server}]",
                            f"{t.server} ({t.how}): {t.failure}; behind that check runner v1 turns on the target's aux "
                            f"outputs for eagle3 and dflash only: the {c.draft.taps} target layers the draft reads "
                            "would never be captured (vllm issue #50851; silent in a release without the check, which "
                            "is UNVERIFIED)", srcs,
                            fix_release(c, raw, t, (RUNNER_V2,), "the vLLM runner v2 serves (a CUDA GPU with Triton)"))
    if t.failure:
        return TitledFinding(f"{_failure_title(t)} [{t.server}]", f"{t.server} ({t.how}): {t.failure}", srcs,
                            fix_failure(c, raw, t))
    if c.trained is None or t.positions == c.trained:
        return None
    wrong = [i for i, (a, b) in enumerate(zip(t.positions, c.trained)) if a != b]
    kind = "the fallback reads other layers" if t.fallback else "the ids read capture other layers"
    return TitledFinding(
        f"DFlash taps: {kind} [{t.server}]",
        f"{t.server} {t.how}: {_pos(t.positions)}; the draft was trained on {_pos(c.trained)} ({c.trained_from}): "
        f"slot{'s' * (len(wrong) > 1)} {', '.join(map(str, wrong))} of {len(t.positions)} differ; the weights load "
        "and nothing fails: acceptance drops (sglang issue #37475)", srcs, fix_ids(c, raw, t))


def _failure_title(t: Taps) -> str:
    if t.failure.startswith("IndexError"):
        return "the last decoder layer in target_layer_ids fails the Qwen3.5 capture"
    if any(w in t.failure for w in WIDTH_WORDS):
        return "the draft's fc width is not the runner's tap count"
    if "markov" in t.failure:
        return "SGLang refuses the DSpark draft's Markov head config"
    return "the engine refuses the draft's layer ids"


def cited(s) -> str:
    """A source as a finding names it: repo, path, release, the symbol read (and the releases read beside it)."""
    also = "" if not s.reviewed else f"; also read: v{s.reviewed[0]}" + (f" .. v{s.reviewed[-1]}" if len(s.reviewed) > 1 else "")
    return f"{s} {s.symbol}{also}"


def _pos(ps) -> str:
    return "[" + ", ".join(map(str, ps)) + "]"


def fixed_config(raw: dict, ids: list[int], layers: int | None = None) -> dict:
    """`raw` with `ids` at dflash_config.target_layer_ids (what SGLang's draft sizes its fc from, and the key read
    first) and at a DSpark draft's own dspark_target_layer_ids where it has one (read before them); `layers`: the
    target's layer count written as dflash_config.num_target_layers (SGLang's draft checks its ids against it)."""
    out = copy.deepcopy(raw)
    block = out.setdefault("dflash_config", {})
    block["target_layer_ids"] = ids
    if out.get("dspark_target_layer_ids") is not None:
        out["dspark_target_layer_ids"] = ids
    if layers is not None:
        block["num_target_layers"] = layers
    return out


def fix_ids(c: BlockCheck, raw: dict, t: Taps) -> str:
    """Write the trained layers into dflash_config.target_layer_ids (the key SGLang and vLLM read first); said only
    once the same replay of the fixed config taps the trained layers."""
    ids = [p.layer if p.layer is not None else -1 for p in c.trained]
    layers, raw_fixed = None, fixed_config(raw, ids)
    fixed = taps(t.server, read_block_draft(raw_fixed, c.path), raw_fixed, c.L, c.model_type, c.hidden)
    if t.server.startswith("sglang") and _bound_refusal(fixed.failure):
        layers, raw_fixed = c.L, fixed_config(raw, ids, c.L)  # SGLang's draft checks the ids against this count
        fixed = taps(t.server, read_block_draft(raw_fixed, c.path), raw_fixed, c.L, c.model_type, c.hidden)
    keys = {"target_layer_ids": ids, **({"num_target_layers": layers} if layers is not None else {})}
    where = f'"dflash_config": {json.dumps(keys)}' + \
        (f', "dspark_target_layer_ids": {json.dumps(ids)}' if raw.get("dspark_target_layer_ids") is not None else "")
    if fixed.failure or fixed.positions != c.trained:
        return f"no fix replayed: writing {where} still taps {_pos(fixed.positions)}{_still(fixed)}"
    return (f"write {where} in the draft config (the keys {t.server} reads); fix replayed: {t.server} then reads "
            f"them and taps {_pos(fixed.positions)}")


def _bound_refusal(failure: str) -> bool:
    """SGLang refusing ids against a layer count (resolve_target_layer_ids' range check, build_target_layer_ids
    under 4 layers): writing the target's count as num_target_layers may clear it."""
    return "target_num_layers=" in failure or "num_target_layers" in failure


def _still(t: Taps) -> str:
    return f" and fails: {t.failure}" if t.failure else ""


def fix_failure(c: BlockCheck, raw: dict, t: Taps) -> str:
    if c.trained is not None and (any(w in t.failure for w in WIDTH_WORDS) or _bound_refusal(t.failure)):
        fixed = fix_ids(c, raw, t)
        if not fixed.startswith("no fix") or not t.server.startswith("sglang"):
            return fixed
    if "markov" in t.failure:
        return ("no fix replayed: the Markov head the draft was trained with is in its training config, not in this "
                "one; write it (dspark_markov_rank, markov_head_type: vanilla, gated or rnn) and check again")
    if t.server.startswith("sglang"):
        later = [f"sglang@{v}" for v in SGLANG_READ if tuple(map(int, v.split("."))) > _v(t.server)]
        return fix_release(c, raw, t, tuple(later), "a later SGLang release")
    return ("no fix replayed: the layers the draft was trained on are unknown; write them at "
            "dflash_config.target_layer_ids, or give them with --train CONVENTION:IDS for tpsim to replay that")


def fix_release(c: BlockCheck, raw: dict, t: Taps, candidates: tuple[str, ...], what: str) -> str:
    """The first of `candidates` whose replay taps the trained layers without failing; none: said so."""
    for server in candidates:
        other = taps(server, c.draft, raw, c.L, c.model_type, c.hidden)
        if not other.failure and not other.nothing and (c.trained is None or other.positions == c.trained):
            return (f"serve with {server} ({what}); fix replayed: it {other.how} and taps "
                    f"{_pos(other.positions)}")
    tried = f" ({candidates[0]} .. {candidates[-1]})" if candidates else ""
    return (f"no fix replayed: no release tpsim read{tried} serves it; sglang PR #32206 (open, in no release) "
            "guards the last layer" if t.failure.startswith("IndexError") else
            f"no fix replayed: none of {', '.join(candidates) or 'the releases read'} serves it")


def _v(server: str) -> tuple[int, ...]:
    return tuple(int(p) for p in server.partition("@")[2].split(":")[0].split("."))


def family_word(d: BlockDraft) -> str:
    return "DSpark" if d.family is Family.DSPARK else "DFlash"
