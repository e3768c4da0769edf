"""Model config: the field names of Hugging Face's config classes, one set per family
(tpsim.config.families: DeepSeek-V2/V3 and Kimi-K2, Llama, Qwen3, Qwen3-MoE, GPT-OSS); what a valid config
holds per family is checked in tpsim.config.checks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml

from tpsim.base.errors import UsageError, quoted, read_text
from tpsim.config.checks import LAYER_TYPES, check_consistency
from tpsim.config.model import ModelConfig
from tpsim.config.families import BY_MODEL_TYPE, DEFAULT_MODEL_TYPE, MODEL_TYPES

# The built-in configs and scenarios: packaged as tpsim/builtin in a wheel (setup.py maps it to the
# repository's configs/, their one source), the repository's configs/ in a checkout.
_PACKAGED = Path(__file__).resolve().parents[1] / "builtin"
BUILTIN_CONFIGS = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL = "tiny"  # the built-in config a run takes without --model


def builtin_names() -> list[str]:
    """The built-in configs `--model NAME` takes (configs/*.yaml)."""
    return sorted(c.stem for c in BUILTIN_CONFIGS.glob("*.yaml"))


_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "extra"}


def _check_type(name: str, value: Any, source: str, shown: str | None = None) -> Any:
    """`value` of tpsim field `name`, checked for its type; errors name it as the config spells it (`shown`)."""
    return check_field(str(_FIELDS[name].type), value, source, shown or name, zero_ok=name == "first_k_dense_replace")


def check_field(ann: str, value: Any, source: str, field: str, zero_ok: bool = False, fix: str = "") -> Any:
    """`value` of a config field annotated `ann` (as a dataclass spells it: "int", "float | None", ...), checked
    for its type (an integer positive, a number finite); errors name it `field` and end with `fix` when given."""
    optional, end = "None" in ann, f"; {fix}" if fix else ""
    if value is None:
        if optional:
            return None
        raise UsageError(f"{source}: field {field} must not be null{end}")
    if ann.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{source}: field {field} must be an integer, got {quoted(value)}{end}")
        if value < 0 or (value == 0 and not zero_ok):
            raise UsageError(f"{source}: field {field} must be positive, got {quoted(value)}{end}")
    elif ann.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{source}: field {field} must be a number, got {quoted(value)}{end}")
        if not math.isfinite(value):
            raise UsageError(f"{source}: field {field} must be a finite number, got {value!r}{end}")
        value = float(value)
    elif ann.startswith("bool"):
        if not isinstance(value, bool):
            raise UsageError(f"{source}: field {field} must be true or false, got {quoted(value)}{end}")
    elif ann.startswith("str"):
        if not isinstance(value, str):
            raise UsageError(f"{source}: field {field} must be a string, got {quoted(value)}{end}")
    elif ann.startswith("dict"):
        if not isinstance(value, dict):
            raise UsageError(f"{source}: field {field} must be a mapping, got {quoted(value)}{end}")
    elif ann.startswith("tuple[int"):  # a list of layer indices
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                       for v in value):
            raise UsageError(f"{source}: field {field} must be a list of layer indices, got {quoted(value)}{end}")
        value = tuple(value)
    elif ann.startswith("tuple[str"):
        if not isinstance(value, (list, tuple)) or any(v not in LAYER_TYPES for v in value):
            raise UsageError(f"{source}: field {field} must be a list of {' or '.join(LAYER_TYPES)}, got "
                             f"{quoted(value)}{end}")
        value = tuple(value)
    return value


def config_from_dict(raw: dict, source: str = "config") -> ModelConfig:
    """Validate a parsed config.json / YAML mapping; every error names the field."""
    if not isinstance(raw, dict):
        raise UsageError(f"{source} must be a mapping of HF config fields, got {type(raw).__name__}")
    model_type = raw.get("model_type", DEFAULT_MODEL_TYPE)
    if model_type not in MODEL_TYPES:  # before its fields: another family's config lacks them
        raise UsageError(f"{source}: model_type={model_type!r} is not supported; tpsim models "
                         f"{', '.join(MODEL_TYPES)}")
    fam = BY_MODEL_TYPE[model_type]
    raw = {fam.aliases.get(k, k) if fam.aliases.get(k) not in raw else k: v for k, v in raw.items()}
    missing = [fam.hf_name(k) for k in fam.required if fam.hf_name(k) not in raw]
    if missing:
        cls = fam.model_types[model_type].replace("ForCausalLM", "Config")
        raise UsageError(f"{source} is missing required field {missing[0]}; add it (HF {cls} name)")
    raw = _standardize_rope(raw, source)
    by_hf = {fam.hf_name(f): f for f in fam.fields}
    known = {by_hf[k]: _check_type(by_hf[k], v, source, k) for k, v in raw.items() if k in by_hf}
    known = {**fam.implied.get(model_type, {}), **known}
    known.update({dst: known[src] for dst, src in fam.copies.items() if src in known})
    if fam.sinks and isinstance(known.get("num_hidden_layers"), int):
        L = known["num_hidden_layers"]
        if "layer_types" not in known:  # transformers GptOssConfig.__post_init__: sliding, full, sliding, ...
            known["layer_types"] = tuple(("sliding_attention", "full_attention")[k % 2] for k in range(min(L, 2**16)))
        known["layer_types"] = known["layer_types"][:L]  # --override num_hidden_layers=N truncates them too
    if known.get("q_lora_rank") == 0:  # DeepSeek's own configs write 0 for "no q LoRA"
        known["q_lora_rank"] = None
    extra = {k: v for k, v in raw.items() if k not in by_hf}
    cfg = ModelConfig(**known, extra=extra)
    check_consistency(cfg, source)
    return cfg


def _standardize_rope(raw: dict, source: str) -> dict:
    """transformers >= 5 writes `rope_parameters` (rope_theta inside, rope_type "default" for no
    scaling) instead of the Hub's `rope_theta` + `rope_scaling`; read both."""
    if "rope_parameters" not in raw or "rope_scaling" in raw:
        return raw
    rp = raw["rope_parameters"]
    if not isinstance(rp, dict):
        raise UsageError(f"{source}: field rope_parameters must be a mapping, got {rp!r}")
    out = {k: v for k, v in raw.items() if k != "rope_parameters"}
    rp = dict(rp)
    if "rope_theta" in rp:
        out["rope_theta"] = rp.pop("rope_theta")
    kind = rp.get("rope_type", rp.get("type", "default"))
    out["rope_scaling"] = None if kind == "default" else rp
    return out


class StrictLoader(yaml.SafeLoader):
    """YAML as configs mean it: a date-like value stays a string (`2001-13-45` made SafeLoader raise
    ValueError), and anchors/aliases are refused (an alias bomb expands to gigabytes)."""

    yaml_implicit_resolvers = {c: [r for r in rs if r[0] != "tag:yaml.org,2002:timestamp"]
                               for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not allowed in a config; write the values out")
        return super().compose_node(parent, index)


def _number(text: str) -> int | float | None:
    """`4` -> 4, `1e6` -> 1e6 (YAML 1.1 would read `1e6` as a string), else None."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None


def with_overrides(cfg: ModelConfig, overrides: list[str]) -> ModelConfig:
    """Apply `field=value` overrides (value parsed as YAML: 4, 2.5, null, true) and re-validate."""
    raw = cfg.to_dict()
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"--override {item!r} is not FIELD=VALUE, e.g. --override num_hidden_layers=4")
        if key not in raw:
            raise UsageError(f"--override {key}: unknown config field of {cfg.model_type}; use one of its "
                             f"config.json fields, such as num_hidden_layers")
        try:
            raw[key] = _number(text.strip()) if _number(text.strip()) is not None else yaml.load(text, Loader=StrictLoader)
        except (yaml.YAMLError, RecursionError):
            raise UsageError(f"--override {item!r}: the value is not a number, true/false, null or a string") from None
    return config_from_dict(raw, source="--override")


def load_config(path: str | Path) -> ModelConfig:
    """Read a YAML or JSON config file, or the config.json inside an HF model directory."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UsageError(f"{p} has no config.json; an HF model directory needs config.json next to "
                             "its *.safetensors")
        p = p / "config.json"
    if not p.exists():
        builtin = builtin_names()
        raise UsageError(f"config file {p} does not exist; pass a YAML/JSON config, an HF model directory"
                         + (f" or a built-in name ({', '.join(builtin)})" if builtin else ""))
    if not p.is_file():  # a FIFO or a device would block or never end
        raise UsageError(f"config {p} is not a regular file; pass a YAML/JSON config or an HF model directory")
    text = read_text(p, "config", "YAML/JSON", "pass a YAML/JSON config or an HF model directory")
    if not text.strip():
        raise UsageError(f"config {p} is empty; write a model's config.json fields into it")
    if "\x00" in text:  # e.g. a *.safetensors file: its 8-byte header length decodes as text
        raise UsageError(f"config {p} is not a text file (binary data, not YAML/JSON); pass a YAML/JSON config "
                         "or an HF model directory")
    try:
        if p.suffix in (".yaml", ".yml"):
            raw = yaml.load(text, Loader=StrictLoader)
        else:
            raw = json.loads(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError
        mark = getattr(e, "problem_mark", None)  # YAML: where the parser gave up
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        first = (getattr(e, "problem", None) or str(e).splitlines()[0] or e.__class__.__name__) + where
        raise UsageError(f"config {p} is not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {first}")
    return config_from_dict(raw, source=str(p))
