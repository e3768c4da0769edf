"""Which target a draft is triaged against: `--model`, else the built-in the draft's own config names
(its `target_hidden_size` or `hidden_size`, its `vocab_size`, the verifier architectures a speculators-format
config names), and, when that target is too big to
run here, the stand-in that replays it (tpsim.config.standin)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpsim.base.errors import UsageError
from tpsim.config.loader import BUILTIN_CONFIGS, builtin_names, load_config
from tpsim.config.model import ModelConfig
from tpsim.config.standin import StandIn, stand_in
from tpsim.draft.config import flat
from tpsim.model.decoder import shard_bytes
from tpsim.offline.align import DraftConfig
from tpsim.run.spec import DEFAULT_MODEL, ModelSource

STAND_IN_ABOVE = 1 << 30  # float32 bytes of the whole target: above this, a stand-in replays it (a laptop's budget)


@dataclass(frozen=True)
class Target:
    name: str
    source: ModelSource  # what the ranks run (the stand-in's config where there is one)
    real: ModelConfig  # the target's own config: the widths findings quote
    chosen: str | None = None  # why this target, when the draft named it
    standin: StandIn | None = None


def draft_width(draft: DraftConfig) -> tuple[int | None, str]:
    """The hidden size the draft's fc was built for, and the key it came from."""
    raw = flat(draft.raw)  # a speculators-format config holds hidden_size in transformer_layer_config
    for key in ("target_hidden_size", "hidden_size"):
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, key
    return None, ""


def target_for(draft: DraftConfig, model: str | None, overrides: list[str], tp: int, device: str = "cpu") -> Target:
    """The target named by --model (checked against the draft's width) or by the draft's own config; on the
    CPU, one too big for a laptop is replayed on a stand-in (on CUDA it runs at its own shapes)."""
    width, key = draft_width(draft)
    chosen = None
    if model is None:
        model, chosen = _named_by_draft(draft, width, key)
    src = ModelSource.load(model, overrides, [])
    if width is not None and src.cfg.hidden_size != width:
        raise UsageError(f"--draft-config {draft.path} was built for a target of hidden size {width} ({key}), and "
                         f"--model {model} has hidden_size {src.cfg.hidden_size}; name the draft's target with --model")
    if src.checkpoint is None and device == "cpu" and shard_bytes(src.cfg, 1, torch.float32) > STAND_IN_ABOVE:
        small = stand_in(src.cfg, tp)
        return Target(model, ModelSource(model, small.cfg), src.cfg, chosen, small)
    return Target(model, ModelSource.load(model, overrides, sorted({1, tp})), src.cfg, chosen)


def _named_by_draft(draft: DraftConfig, width: int | None, key: str) -> tuple[str, str | None]:
    if width is None:
        return DEFAULT_MODEL, None
    vocab = flat(draft.raw).get("vocab_size")
    arch = _verifier_architectures(draft.raw)
    fits = [n for n in builtin_names() if _fits(load_config(BUILTIN_CONFIGS / f"{n}.yaml"), width, vocab, arch)]
    if DEFAULT_MODEL in fits:  # the drafts shipped with tpsim are the tiny built-in's
        return DEFAULT_MODEL, None
    said = f"{key} {width}" + (f" and vocab_size {vocab}" if isinstance(vocab, int) else "") + \
        (f" and verifier {', '.join(arch)}" if arch else "")
    if len(fits) != 1:
        which = f"{', '.join(fits)} all match its {said}" if fits else f"no built-in target matches its {said}"
        raise UsageError(f"--draft-config {draft.path}: {which}; name the target with --model (a built-in, "
                         "or the target's config.json or checkpoint directory)")
    return fits[0], f"the built-in whose hidden_size and vocab_size match the draft's {said}; --model names another"


def _verifier_architectures(raw: dict) -> list[str]:
    """The target's architectures where the draft names them (the speculators format's verifier)."""
    verifier = (raw.get("speculators_config") or {}).get("verifier") if isinstance(raw.get("speculators_config"),
                                                                                     dict) else None
    archs = verifier.get("architectures") if isinstance(verifier, dict) else None
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def _fits(cfg: ModelConfig, width: int, vocab, arch: list[str]) -> bool:
    return cfg.hidden_size == width and (not isinstance(vocab, int) or cfg.vocab_size == vocab) and \
        (not arch or cfg.family.model_types.get(cfg.model_type) in arch)


def check_vocab(target: Target, vocab: int, draft: str) -> None:
    """A draft run on a target shares its vocabulary (its embedding is the target's, its d2t maps into it): another
    vocabulary size is one line before any rank starts (it was a ValueError inside the draft's load)."""
    if vocab != target.real.vocab_size:
        raise UsageError(f"{draft}: the draft's vocab_size {vocab} is not {target.name}'s {target.real.vocab_size}; a "
                         "draft runs on the target it was trained for: name that target with --model")
