"""An EAGLE-3 draft's config.json, as the keys SpecForge writes and the engines read (research doc §2.1), or in
the `speculators` format vLLM reads (the layer's keys nested in `transformer_layer_config`, the draft's own at
the top: speculators 0.9.0 `Eagle3SpeculatorConfig.save_pretrained`). Every key tpsim or an engine reads is checked
here, for type and range (`check_keys`; `DraftConfig.from_json` adds the keys a draft needs and their shapes): one
UsageError naming the key, the value and the fix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from textwrap import shorten

from tpsim.base.errors import UsageError, quoted
from tpsim.config.checks import MAX_TENSOR_ELEMENTS, check_heads, check_rms_norm_eps, check_rope_scaling, \
    check_rope_theta, check_tensor_sizes
from tpsim.config.loader import check_field

KEY = "eagle_aux_hidden_state_layer_ids"
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
SIZES = (*REQUIRED, "num_key_value_heads", "head_dim", "draft_vocab_size", "target_hidden_size")
# the engines test a draft's flags for truth (getattr(config, "norm_output", False)): "false" is read as true
BOOLEAN = 'write true or false, unquoted (SGLang and vLLM read any non-empty string as true, "false" too)'
# every key tpsim or an engine reads from a draft's config.json: its type in annotation words (checked by
# tpsim.config.loader.check_field, as a target's fields are; "| None": null is the default), and what to write
# instead; "a.b" is b inside a
KEYS = {
    "hidden_size": ("int", 'write the draft\'s hidden size, e.g. "hidden_size": 4096'),
    "intermediate_size": ("int", 'write the draft MLP\'s width, e.g. "intermediate_size": 14336'),
    "num_attention_heads": ("int", 'write e.g. "num_attention_heads": 32'),
    "num_key_value_heads": ("int | None", 'write e.g. "num_key_value_heads": 8, or remove it (one per attention head)'),
    "head_dim": ("int | None", 'write e.g. "head_dim": 128, or remove it (hidden_size / num_attention_heads)'),
    "vocab_size": ("int", 'write the target\'s vocabulary size, e.g. "vocab_size": 128256'),
    "draft_vocab_size": ("int | None", 'write e.g. "draft_vocab_size": 32000, or remove it (the whole vocab_size)'),
    "target_hidden_size": ("int | None", 'write the target\'s hidden size, e.g. "target_hidden_size": 4096, or '
                                         "remove it (the draft's hidden_size)"),
    "num_aux_hidden_states": ("int | None", "write how many layers the draft was trained on, e.g. "
                                            '"num_aux_hidden_states": 3, or remove it (one per layer id, else 3)'),
    "rms_norm_eps": ("float | None", 'write e.g. "rms_norm_eps": 1e-05'),
    "rope_theta": ("float | None", 'write the base the draft was trained with, e.g. "rope_theta": 10000.0'),
    "rope_scaling": ("dict | None", 'write null, or a mapping such as {"rope_type": "llama3", "factor": 8.0, '
                                    '"low_freq_factor": 1.0, "high_freq_factor": 4.0, '
                                    '"original_max_position_embeddings": 8192}'),
    "rope_parameters": ("dict | None", 'write a mapping such as {"rope_theta": 10000.0, "rope_type": "default"}'),
    "fc_norm": ("bool | None", BOOLEAN),
    "norm_before_fc": ("bool | None", BOOLEAN),
    "norm_before_residual": ("bool | None", BOOLEAN),
    "norm_output": ("bool | None", BOOLEAN),
    "eagle_config": ("dict | None", f'write "eagle_config": {{"{KEY}": [1, 29, 57]}}'),
    "eagle_config.norm_before_fc": ("bool | None", BOOLEAN),
    "eagle_config.use_aux_hidden_state": ("bool | None", BOOLEAN),
}
# every place an engine or trainer reads layer ids from (tpsim/profiles/draft.py; vLLM's runner v2,
# tpsim/profiles/vllm.py), and how an error names it
ID_PATHS = (("eagle_config", KEY), (KEY,), ("dflash_config", "target_layer_ids"), ("dspark_target_layer_ids",),
            ("target_layer_ids",), ("dflash_config", "layer_ids"), ("eagle_config", "layer_ids"))
ID_KEYS = tuple((p, f"top-level {KEY}" if p == (KEY,) else ".".join(p)) for p in ID_PATHS)
MAX_IDS = 256  # far past any draft's (EAGLE-3 three, DFlash five), and what bounds a replay's cost
ROPE_TYPES = ("llama3", "yarn")  # besides default: what NeoxRotaryEmbedding computes
MAX_DEPTH = 16  # a draft config nests four deep (speculators_config.verifier.architectures)
ABSENT = object()


def value_at(raw: dict, path: tuple[str, ...]):
    """raw[path[0]][path[1]]..., None where any step is missing or not an object."""
    v = raw
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return v


def check_id_count(ids: list[int] | None) -> None:
    """More than MAX_IDS ids is not a capture any engine or trainer was given (a config with 10**6 copies
    of one id ran for minutes): refused before any work."""
    if ids is not None and len(ids) > MAX_IDS:
        raise UsageError(f"{len(ids)} layer ids is more than tpsim replays (at most {MAX_IDS}); give one id per "
                         "aux hidden state (an EAGLE-3 draft takes three)")


class Layout(Enum):
    """How a draft checkpoint names its config keys and tensors."""

    SPECFORGE = "specforge"  # config.json flat, the layer's tensors `midlayer.*` (SGLang's export too)
    SPECULATORS = "speculators"  # `transformer_layer_config` + `speculators_config`, the layer's tensors `layers.0.*`
    EAGLE = "eagle"  # the EAGLE repository's: SpecForge's keys in a `pytorch_model.bin` (torch.save of a state dict)

    @classmethod
    def of(cls, raw: dict) -> "Layout":
        nested = isinstance(raw.get("transformer_layer_config"), dict) and "speculators_config" in raw
        return cls.SPECULATORS if nested else cls.SPECFORGE

    @property
    def layer_prefix(self) -> str:
        return "layers.0." if self is Layout.SPECULATORS else "midlayer."


def flat(raw: dict) -> dict:
    """The config's keys as SpecForge writes them: a speculators config's layer keys lifted to the top (the
    draft's own keys win; `rope_parameters.rope_theta` read as `rope_theta`)."""
    if Layout.of(raw) is Layout.SPECFORGE:
        return raw
    layer = dict(raw["transformer_layer_config"])
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in layer:
        layer["rope_theta"] = rope["rope_theta"]
    return {**layer, **{k: v for k, v in raw.items() if v is not None and k != "transformer_layer_config"}}


def spelled(raw: dict, key: str) -> str:
    """`key` of `flat(raw)` as the config spells it: a speculators config's layer keys inside
    transformer_layer_config."""
    if Layout.of(raw) is Layout.SPECFORGE or raw.get(key.split(".")[0]) is not None:
        return key
    layer = raw["transformer_layer_config"]
    inside = "rope_parameters." if key == "rope_theta" and "rope_theta" not in layer else ""
    return f"transformer_layer_config.{inside}{key}"


def check_keys(raw, source: str) -> dict:
    """Every key of draft config `raw` that tpsim or an engine reads, where present, checked for type and range (a
    config may hold its ids alone: `tpsim align`); `flat(raw)` returned. `source` starts each error."""
    if not isinstance(raw, dict):
        raise UsageError(f"{source} holds a JSON {type(raw).__name__}, not an object; give the draft's config.json")
    _check_depth(raw, source)
    keys = flat(raw)
    for key, (ann, fix) in KEYS.items():
        value = _at(keys, key)
        if value is not ABSENT:
            check_field(ann, value, source, spelled(raw, key), fix=fix)
    _check_ranges(raw, keys, source)
    for path, where in ID_KEYS:
        check_ids(value_at(keys, path), where, source)
    return keys


def _at(keys: dict, key: str):
    """keys["a"]["b"] for "a.b"; ABSENT where a step is missing (None: the config writes null)."""
    v = keys
    for k in key.split("."):
        if not isinstance(v, dict) or k not in v:
            return ABSENT
        v = v[k]
    return v


def _check_depth(raw: dict, source: str) -> None:
    """Refuse JSON nested past MAX_DEPTH before anything recurses into it (quoting or comparing a value), naming
    the key that holds it."""
    stack = [(v, 2, (k,)) for k, v in raw.items()]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            key = ".".join(path[:2] if path[0] == "transformer_layer_config" else path[:1])
            raise UsageError(f"{source}: {key} is JSON nested too deeply (more than {MAX_DEPTH} levels; a draft config "
                             "nests four); give the draft's config.json")
        if isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack += [(v, depth + 1, (*path, str(k))) for k, v in items if isinstance(v, (dict, list))]


def _check_ranges(raw: dict, keys: dict, source: str) -> None:
    """What a type does not say: sizes and the aux count bounded, a norm's eps and RoPE's numbers usable."""
    for key in SIZES:  # each is one dimension of some weight: past the bound, so is that weight
        n = keys.get(key)
        if n is not None and n > MAX_TENSOR_ELEMENTS:
            raise UsageError(f"{source}: field {spelled(raw, key)} must be at most {MAX_TENSOR_ELEMENTS:.3g} (no "
                             f"tensor tpsim builds holds more elements), got {quoted(n)}; {KEYS[key][1]}")
    n = keys.get("num_aux_hidden_states")
    if n is not None and n > MAX_IDS:
        raise UsageError(f"{source}: field num_aux_hidden_states={n} exceeds {MAX_IDS} (an EAGLE-3 draft takes 3); "
                         f"{KEYS['num_aux_hidden_states'][1]}")
    if keys.get("rms_norm_eps") is not None:
        check_rms_norm_eps(keys["rms_norm_eps"], source)
    rs = keys.get("rope_scaling")
    scaled = rs is not None and rope_type(rs) != "default"
    if scaled:
        check_rope_scaling(rs, source, ROPE_TYPES, "an EAGLE-3 draft")
    if keys.get("rope_theta") is not None:
        check_rope_theta(keys["rope_theta"], scaled, source)


def rope_type(rope_scaling: dict):
    """The scaling type, as tpsim.layers.rope.NeoxRotaryEmbedding reads it."""
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def check_ids(value, where: str, source: str) -> None:
    """The layer ids at `where` (None: absent or null): a list of integers, at most MAX_IDS of them."""
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in value):
        raise UsageError(f"{source}: {where} is {shorten(json.dumps(value), 80)}, not a list of integer layer ids; "
                         "write e.g. [1, 29, 57]")
    try:
        check_id_count(value)
    except UsageError as e:
        raise UsageError(f"{source}: {where}: {e}") from None


@dataclass(frozen=True)
class DraftConfig:
    """A draft's sizes and flags, each of its type and in range when read from config.json (`from_json`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    num_aux: int = 3  # num_aux_hidden_states, else the number of layer ids, else 3 (SGLang >= 0.5.12, vLLM 0.33.0)
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux chunk before fc (SpecForge PR #568)
    norm_before_fc: bool = False  # one RMSNorm (`input_norm`) over the whole [T, 3*Ht] before fc (SGLang PR #32334)
    norm_before_residual: bool = False  # vLLM llama_eagle3 `_norm_before_residual`
    norm_output: bool = False  # EAGLE-3.1: the next step is fed the final-normed hidden, not the pre-norm one
    aux_layer_ids: tuple[int, ...] | None = None
    nested_norm_before_fc: bool | None = None  # eagle_config.norm_before_fc (None: not there), read first by some
    use_aux_hidden_state: bool = True  # eagle_config.use_aux_hidden_state: false, vLLM builds no fc

    @classmethod
    def from_json(cls, raw: dict, source: str = "draft config") -> "DraftConfig":
        """The draft a parsed config.json describes (SpecForge's keys or the speculators layout); UsageError, one
        line naming the key, the value and the fix, on anything an engine would misread or tpsim cannot build."""
        keys = check_keys(raw, source)
        missing = [k for k in REQUIRED if k not in keys]
        if missing:
            raise UsageError(f"{source}: an EAGLE-3 draft config needs {', '.join(REQUIRED[:-1])} and {REQUIRED[-1]}; "
                             f"add {spelled(raw, missing[0])} ({KEYS[missing[0]][1]})")
        check_heads(keys["num_attention_heads"], _given(keys, "num_key_value_heads", keys["num_attention_heads"]),
                    keys["hidden_size"], keys.get("head_dim"), source)
        cfg = cls._of(keys)
        check_tensor_sizes(cfg.tensor_sizes(), source)
        return cfg

    @classmethod
    def _of(cls, keys: dict) -> "DraftConfig":
        """The config of `keys` (flat, checked): an absent or null key its default."""
        h, heads = keys["hidden_size"], keys["num_attention_heads"]
        eagle, ids = keys.get("eagle_config") or {}, layer_ids(keys)
        return cls(
            hidden_size=h, intermediate_size=keys["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=_given(keys, "num_key_value_heads", heads),
            head_dim=_given(keys, "head_dim", h // heads),
            vocab_size=keys["vocab_size"], draft_vocab_size=_given(keys, "draft_vocab_size", keys["vocab_size"]),
            target_hidden_size=_given(keys, "target_hidden_size", h), rms_norm_eps=_given(keys, "rms_norm_eps", 1e-6),
            rope_theta=_given(keys, "rope_theta", 10000.0), rope_scaling=keys.get("rope_scaling"),
            num_aux=aux_count(keys),
            fc_norm=keys.get("fc_norm") is True, norm_before_fc=keys.get("norm_before_fc") is True,
            norm_before_residual=keys.get("norm_before_residual") is True, norm_output=keys.get("norm_output") is True,
            aux_layer_ids=tuple(ids) if ids else None,
            nested_norm_before_fc=None if "norm_before_fc" not in eagle else eagle["norm_before_fc"] is True,
            use_aux_hidden_state=eagle.get("use_aux_hidden_state") is not False)

    def tensor_sizes(self) -> list[tuple[int, str]]:
        """(elements, what makes it) of each of the draft's weights, for check_tensor_sizes."""
        h, d, heads, kv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        return [(self.vocab_size * h, f"vocab_size x hidden_size ({self.vocab_size} x {h})"),
                (self.draft_vocab_size * h, f"draft_vocab_size x hidden_size ({self.draft_vocab_size} x {h})"),
                (self.intermediate_size * h, f"intermediate_size x hidden_size ({self.intermediate_size} x {h})"),
                ((heads + 2 * kv) * d * 2 * h, f"the qkv projection ((num_attention_heads {heads} + 2 x "
                                               f"num_key_value_heads {kv}) x head_dim {d} x 2 x hidden_size {h})"),
                (self.capture_width * h, f"fc (num_aux_hidden_states {self.num_aux} x target_hidden_size "
                                         f"{self.target_hidden_size} x hidden_size {h})")]

    @property
    def capture_width(self) -> int:
        return self.num_aux * self.target_hidden_size


def layer_ids(keys: dict) -> list[int] | None:
    """The draft's layer ids, eagle_config's over the top-level key (flat, checked keys)."""
    return (keys.get("eagle_config") or {}).get(KEY, keys.get(KEY))


def aux_count(keys: dict) -> int:
    """How many aux states the draft's fc takes: num_aux_hidden_states, else one per layer id, else 3."""
    ids = layer_ids(keys)
    return _given(keys, "num_aux_hidden_states", len(ids) if ids else 3)


def _given(keys: dict, key: str, default):
    """keys[key], or `default` where the config leaves it out or writes null."""
    value = keys.get(key)
    return default if value is None else value
