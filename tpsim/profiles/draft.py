"""How a profiled engine reads the capture ids from a draft's config.json: the keys it tries in
order, what an empty list does, the flag that turns capture off, and why it fell back to its
default when it did."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tpsim.draft.config import value_at
from tpsim.profiles.profile import NESTED, TOP, ConfigKey, Profile


@dataclass(frozen=True)
class ConfigIds:
    """What `profile` takes from the config: `ids` (None: its default), the key they came from,
    and, when it fell back or failed, why."""

    ids: list[int] | None
    key: ConfigKey | None
    fallback: str | None = None  # why the default is used although the config names ids
    ignored: list[int] | None = None  # those ids, at a key this engine never reads
    off: bool = False  # the config turns capture off
    failure: str | None = None  # the engine fails on this config (e.g. an empty list)

    @property
    def where(self) -> str:
        return str(self.key) if self.key is not None else "default"


def read_ids(profile: Profile, raw: dict) -> ConfigIds:
    """The ids `profile` reads from draft config `raw` (already type-checked: every id list is a
    list of ints)."""
    read = profile.behaviour.config.value
    who = profile.name
    if read.hard_coded or not read.keys:
        return ConfigIds(None, None)
    if read.off_flag and value_at(raw, read.off_flag) is False:
        return ConfigIds(None, None, off=True,
                         failure=f"{'.'.join(read.off_flag)} is false: {who} captures nothing and the draft's fc "
                                 "gets no aux hidden states")
    for key in read.keys:
        v = value_at(raw, key.path)
        if v in (None, []) and read.decided_by == key.path[:-1] and value_at(raw, read.decided_by):
            return _decided(read, raw, key, who)
        if v is None:
            continue
        if v == []:
            if read.empty.failure is None:
                continue
            return ConfigIds(None, key, failure=f"{key} is an empty list: {who} {read.empty.failure}; write the ids "
                                                "(e.g. [1, 29, 57]) or remove the key for the default")
        return ConfigIds([j + key.shift for j in v], key)
    elsewhere = next((p for p in _ID_PLACES if value_at(raw, p) and p not in {k.path for k in read.keys}), None)
    if elsewhere is None:
        return ConfigIds(None, None)
    ignored = value_at(raw, elsewhere)
    reads = " then ".join(str(k) for k in read.keys)
    return ConfigIds(None, None, fallback=f"{who} reads {reads}; this config has ids only at {'.'.join(elsewhere)} "
                                          f"({ignored}), which it never reads", ignored=ignored)


def _decided(read, raw: dict, key: ConfigKey, who: str) -> ConfigIds:
    """`key`'s parent is a non-empty object without `key`: the engine takes None from it, its default; ids at a
    later key are dropped."""
    later = next(((k, value_at(raw, k.path)) for k in read.keys[read.keys.index(key) + 1:] if value_at(raw, k.path)),
                 None)
    if later is None:
        return ConfigIds(None, None)
    parent = ".".join(read.decided_by)
    return ConfigIds(None, None, fallback=f"{who} reads {key} whenever {parent} is an object, after {later[0]}: this "
                                          f"config's {parent} has no ids, so its {later[0].path[0]} ids "
                                          f"({later[1]}) are dropped for the default", ignored=later[1])


def write_ids(raw: dict, profile: Profile, ids: list[int]) -> None:
    """Write `ids` (in `profile`'s numbering) into draft config `raw` at the key `profile` reads first."""
    key = profile.behaviour.config.value.keys[0]
    at = raw
    for k in key.path[:-1]:
        at = at.setdefault(k, {})
    at[key.path[-1]] = [j - key.shift for j in ids]


def write_ids_hint(profile: Profile, ids: list[int]) -> str:
    """Where to write `ids` in the draft config so that `profile` reads them."""
    keys = profile.behaviour.config.value.keys
    if not keys:
        return f"pass ids {ids} to {profile.engine}"
    path = keys[0].path
    value = json.dumps([j - keys[0].shift for j in ids])
    text = value
    for k in reversed(path):
        text = f'{{"{k}": {text}}}'
    where = "the top level" if len(path) == 1 else ".".join(path[:-1])
    return f"write {text[1:-1]} in the draft config ({where}, which {profile.name} reads first)"


# every place some program reads ids from, to say where a config's ids sit when a reader misses them
_ID_PLACES = (NESTED, TOP, ("dflash_config", "target_layer_ids"))
