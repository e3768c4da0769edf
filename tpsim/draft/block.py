"""A block draft's config: DFlash (z-lab) and DSpark (DeepSeek DeepSpec) drafts predict a block of tokens from
several target layers' hidden states (often five, not EAGLE-3's three). What their config says, read the way the
released loaders read it (SGLang dflash_utils.parse_dflash_draft_config, vLLM qwen3_dflash.py and
eagle3_utils.py): the target layer ids (or none: the engine computes or defaults them), the draft's own layer
count (SGLang's fallback takes one tap per draft layer), the block size and the mask token."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.base.errors import UsageError
from tpsim.draft.config import check_ids, value_at

DFLASH_IDS = ("dflash_config", "target_layer_ids")


class Family(Enum):
    """Which block drafter: the speculative method an engine serves it with."""

    DFLASH = "dflash"
    DSPARK = "dspark"


@dataclass(frozen=True)
class BlockDraft:
    """A DFlash or DSpark draft's config as the engines read it (`ids`: None where the config has none)."""

    family: Family
    architectures: tuple[str, ...]
    num_hidden_layers: int  # the draft's own layers: SGLang's fallback computes one tap per layer
    ids: tuple[int, ...] | None  # the target layer ids, as the trainer wrote them (output of layer j)
    ids_key: str | None  # where they were read: dflash_config.target_layer_ids, target_layer_ids, ...
    num_target_layers: int | None  # the target the draft was trained on, where the config says
    block_size: int | None
    mask_token_id: int | None
    fc_ids: tuple[int, ...] | None = None  # the DFlash ids (dflash_config.target_layer_ids, else target_layer_ids):
    # SGLang's draft sizes its fc from these, never from dspark_target_layer_ids (models/dflash.py)

    @property
    def taps(self) -> int:
        """How many target layers the draft's fc takes: its ids, else one per draft layer (what SGLang's
        fallback and vLLM's qwen3_dflash fc both assume)."""
        return len(self.ids) if self.ids is not None else self.num_hidden_layers


def is_block_draft(raw) -> bool:
    """Whether a parsed config.json is a DFlash or DSpark draft (by its architecture, or a dflash_config with a
    block's keys); an EAGLE-3 draft whose ids sit under dflash_config is not one."""
    if not isinstance(raw, dict):
        return False
    archs = raw.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if any("dflash" in a.lower() or "dspark" in a.lower() for a in names):
        return True
    if any("eagle" in a.lower() for a in names):
        return False
    block = raw.get("dflash_config")
    return isinstance(block, dict) and ("block_size" in block or "mask_token_id" in block)


def read_block_draft(raw: dict, source: str) -> BlockDraft:
    """The block draft `raw` describes; UsageError, one line naming the key and the fix, on a value no loader
    takes."""
    archs = tuple(a for a in raw.get("architectures") or () if isinstance(a, str))
    family = Family.DSPARK if any("dspark" in a.lower() for a in archs) or "markov_rank" in raw else Family.DFLASH
    block = raw.get("dflash_config")
    if block is not None and not isinstance(block, dict):
        raise UsageError(f"{source}: dflash_config is {type(block).__name__}, not an object; write e.g. "
                         '"dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16}')
    layers = _count(raw, "num_hidden_layers", source, required=True)
    ids, key = _ids(raw, family, source)
    fc_ids = ids if family is Family.DFLASH else _ids(raw, Family.DFLASH, source)[0]
    return BlockDraft(family, archs, layers, ids, key, _nested_count(raw, "num_target_layers", source),
                      _nested_count(raw, "block_size", source), _mask_id(raw, source), fc_ids)


def _ids(raw: dict, family: Family, source: str) -> tuple[tuple[int, ...] | None, str | None]:
    """SGLang's order: dflash_config.target_layer_ids, else the top-level target_layer_ids; a DSpark draft's
    dspark_target_layer_ids first (vLLM's runner v2 reads it first)."""
    places = [(("dspark_target_layer_ids",), "dspark_target_layer_ids")] if family is Family.DSPARK else []
    places += [(DFLASH_IDS, "dflash_config.target_layer_ids"), (("target_layer_ids",), "target_layer_ids")]
    for path, name in places:
        value = value_at(raw, path)
        check_ids(value, name, source)
        if value is not None:
            if not value:
                raise UsageError(f"{source}: {name} is an empty list (SGLang refuses it: must be non-empty); write "
                                 "the ids the draft was trained on, e.g. [1, 9, 17, 25, 33]")
            if min(value) < 0:
                raise UsageError(f"{source}: {name} holds {min(value)}; a target layer id is 0 or more (SGLang "
                                 "refuses it as out of range)")
            return tuple(value), name
    return None, None


def _count(raw: dict, key: str, source: str, required: bool = False) -> int | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
        raise UsageError(f"{source}: {key} is {value!r}; a DFlash draft config needs {key} as a count from 1 to "
                         f"4096 (e.g. \"{key}\": 5)")
    return value


def _nested_count(raw: dict, key: str, source: str) -> int | None:
    """dflash_config's `key`, else the top level's (SGLang: 'Keep support for current checkpoints where block_size
    is top-level')."""
    block = raw.get("dflash_config") or {}
    return _count({key: block[key]} if block.get(key) is not None else raw, key, source)


def _mask_id(raw: dict, source: str) -> int | None:
    block = raw.get("dflash_config") or {}
    value = block.get("mask_token_id", raw.get("mask_token_id"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise UsageError(f"{source}: dflash_config.mask_token_id is {value!r}; write a non-negative token id "
                         "(SGLang refuses anything else)")
    return value
