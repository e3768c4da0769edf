"""Model config: the field names of Hugging Face's config classes, one set per family
(tpsim.families: DeepSeek-V2/V3 and Kimi-K2, Llama, Qwen3, Qwen3-MoE)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpsim.errors import UsageError, read_text
from tpsim.families import BY_MODEL_TYPE, DEFAULT_MODEL_TYPE, MODEL_TYPES, Attention, Family, MoeLayout

VOCAB_PADDING = 64  # SGLang / vLLM DEFAULT_VOCAB_PADDING_SIZE
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# The built-in configs and scenarios: packaged as tpsim/builtin in a wheel (setup.py maps it to the
# repository's configs/, their one source), the repository's configs/ in a checkout.
_PACKAGED = Path(__file__).resolve().parent / "builtin"
BUILTIN_CONFIGS = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parent.parent / "configs"
SCORING_FUNCS = ("softmax", "sigmoid")


def builtin_names() -> list[str]:
    """The built-in configs `--model NAME` takes (configs/*.yaml)."""
    return sorted(c.stem for c in BUILTIN_CONFIGS.glob("*.yaml"))
# rope_scaling fields the YaRN maths reads (the first four must be positive)
YARN_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attn_factor")
LLAMA3_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_TYPES = {Attention.MLA: ("yarn",), Attention.GQA: ("llama3", "yarn")}  # besides none (rope_type default)
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder of one of tpsim's families. A field the family does not have keeps its default;
    the family says which fields must be present (`Family.required`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    head_dim: int | None = None  # GQA; None: hidden_size // num_attention_heads
    attention_bias: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None  # GPT-OSS: keys a sliding-attention layer sees, the query's own included
    layer_types: tuple[str, ...] = ()  # GPT-OSS: sliding_attention / full_attention per layer
    swiglu_limit: float = 7.0  # GPT-OSS's clamped SwiGLU
    model_type: str = DEFAULT_MODEL_TYPE
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> Family:
        return BY_MODEL_TYPE[self.model_type]

    @property
    def mla(self) -> bool:
        return self.family.attention is Attention.MLA

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """GQA's head size."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # --- derived sizes -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PADDING) * VOCAB_PADDING

    def is_moe_layer(self, k: int) -> bool:
        if self.n_routed_experts is None:
            return False
        if self.family.moe is MoeLayout.EVERY:
            return True
        if self.family.moe is MoeLayout.QWEN:
            return k not in self.mlp_only_layers and (k + 1) % self.decoder_sparse_step == 0
        return k >= self.first_k_dense_replace and k % self.moe_layer_freq == 0

    @property
    def first_moe_layer(self) -> int | None:
        """The first MoE layer (None: the model has none), found without looping: L may be 10**9."""
        if self.n_routed_experts is None:
            return None
        if self.family.moe is MoeLayout.EVERY:
            first = 0
        elif self.family.moe is MoeLayout.QWEN:
            first = self.decoder_sparse_step - 1
            while first in self.mlp_only_layers:
                first += self.decoder_sparse_step
        else:
            f = self.moe_layer_freq
            first = -(-self.first_k_dense_replace // f) * f
        return None if first >= self.num_hidden_layers else first

    @property
    def first_dense_layer(self) -> int | None:
        """The first layer with a dense MLP (None: every layer is MoE). A dense layer, if any, is
        layer 0, layer 1 or one of mlp_only_layers under both layouts."""
        L = self.num_hidden_layers
        return next((k for k in sorted({0, 1, *self.mlp_only_layers}) if k < L and not self.is_moe_layer(k)), None)

    def moe_layer_count(self) -> int:
        """How many of the layers are MoE, counted without looping over them."""
        first = self.first_moe_layer
        if first is None:
            return 0
        if self.family.moe is MoeLayout.EVERY:
            return self.num_hidden_layers
        if self.family.moe is MoeLayout.QWEN:
            s, L = self.decoder_sparse_step, self.num_hidden_layers
            return L // s - sum(1 for m in set(self.mlp_only_layers) if m < L and (m + 1) % s == 0)
        return (self.num_hidden_layers - 1 - first) // self.moe_layer_freq + 1

    def window(self, k: int) -> int | None:
        """The sliding window of layer k's attention (None: full attention)."""
        sliding = k < len(self.layer_types) and self.layer_types[k] == "sliding_attention"
        return self.sliding_window if sliding else None

    def to_dict(self) -> dict:
        """The config.json fields of this model's family, by the family's names."""
        fam = self.family
        d = {fam.hf_name(f): getattr(self, f) for f in fam.fields}
        for name in ("mlp_only_layers", "layer_types"):
            if name in d:
                d[name] = list(d[name])
        return {**self.extra, **d}

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    def check_tp(self, tp: int) -> None:
        """Raise UsageError naming the first dimension that `tp` does not divide."""
        if tp < 1:
            raise UsageError(f"--tp {tp} must be a positive integer")
        dims = [("num_attention_heads", self.num_attention_heads)]
        if self.first_dense_layer is not None:
            dims.append(("intermediate_size", self.intermediate_size))
        if self.first_moe_layer is not None:
            dims.append(("moe_intermediate_size", self.moe_intermediate_size))
        dims.append(("padded vocab_size", self.padded_vocab_size))
        for name, value in dims:
            if value % tp:
                raise UsageError(f"--tp {tp} does not divide {name}={value}; "
                                 f"pick a --tp that divides it")
        kv = self.kv_heads
        if not self.mla and kv % tp and tp % kv:  # KV heads split (kv % tp == 0) or replicated (tp % kv == 0)
            raise UsageError(f"--tp {tp} neither divides nor is a multiple of num_key_value_heads={kv}; "
                             "pick a --tp that does one or the other")


_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "extra"}


def _check_type(name: str, value: Any, source: str) -> Any:
    ann = str(_FIELDS[name].type)
    optional = "None" in ann
    if value is None:
        if optional:
            return None
        raise UsageError(f"{source}: field {name} must not be null")
    if ann.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{source}: field {name} must be an integer, got {value!r}")
        if value < 0 or (value == 0 and name not in ("first_k_dense_replace",)):
            raise UsageError(f"{source}: field {name} must be positive, got {value}")
    elif ann.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{source}: field {name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise UsageError(f"{source}: field {name} must be a finite number, got {value!r}")
        value = float(value)
    elif ann.startswith("bool"):
        if not isinstance(value, bool):
            raise UsageError(f"{source}: field {name} must be true or false, got {value!r}")
    elif ann.startswith("str"):
        if not isinstance(value, str):
            raise UsageError(f"{source}: field {name} must be a string, got {value!r}")
    elif ann.startswith("dict"):
        if not isinstance(value, dict):
            raise UsageError(f"{source}: field {name} must be a mapping, got {value!r}")
    elif ann.startswith("tuple[int"):  # a list of layer indices
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                       for v in value):
            raise UsageError(f"{source}: field {name} must be a list of layer indices, got {value!r}")
        value = tuple(value)
    elif ann.startswith("tuple[str"):
        if not isinstance(value, (list, tuple)) or any(v not in LAYER_TYPES for v in value):
            raise UsageError(f"{source}: field {name} must be a list of {' or '.join(LAYER_TYPES)}, got {value!r}")
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
    known = {by_hf[k]: _check_type(by_hf[k], v, source) for k, v in raw.items() if k in by_hf}
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
    _check_consistency(cfg, source)
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


def check_quantization_config(q, source: str, model_type: str | None = None) -> tuple[int, int] | None:
    """The (rows, cols) weight block size of a supported block-FP8 `quantization_config`, None for
    GPT-OSS's MXFP4 experts, else UsageError."""
    hint = ("tpsim reads unquantized checkpoints, DeepSeek-V3's block-wise fp8 (quant_method fp8, fmt e4m3) "
            "and GPT-OSS's mxfp4 experts")
    if not isinstance(q, dict):
        raise UsageError(f"{source}: quantization_config must be a mapping; {hint}")
    if q.get("quant_method") == "mxfp4" and model_type in (None, "gpt_oss"):
        return None
    if q.get("quant_method") != "fp8":
        raise UsageError(f"{source}: quantization_config quant_method={q.get('quant_method')!r} is not supported; {hint}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise UsageError(f"{source}: quantization_config fmt={q.get('fmt')!r} is not supported; {hint}")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UsageError(f"{source}: quantization_config weight_block_size={block!r} is not supported "
                         "(per-tensor fp8); tpsim needs block scales such as [128, 128]")
    return block[0], block[1]


def _check_consistency(cfg: ModelConfig, source: str) -> None:
    quant = cfg.extra.get("quantization_config")
    if quant is not None:
        check_quantization_config(quant, source, cfg.model_type)
    if cfg.hidden_act != "silu":
        raise UsageError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported; use silu")
    (_check_mla if cfg.mla else _check_gqa)(cfg, source)
    if cfg.n_routed_experts is not None:
        _check_moe(cfg, source)
    if cfg.rope_scaling is not None:
        _check_rope_scaling(cfg, source)
    if cfg.rope_theta <= 0 or (cfg.rope_theta == 1 and cfg.rope_scaling is not None):
        raise UsageError(f"{source}: rope_theta={cfg.rope_theta:g} must be positive (and not 1 with rope scaling)")
    if cfg.rms_norm_eps < 0:
        raise UsageError(f"{source}: rms_norm_eps={cfg.rms_norm_eps:g} must not be negative; models use 1e-5 or 1e-6")
    _check_sizes(cfg, source)


def _check_mla(cfg: ModelConfig, source: str) -> None:
    if cfg.extra.get("rope_interleave") is False:
        raise UsageError(f"{source}: rope_interleave=false (NeoX-permuted rope weights) is not supported; "
                         "tpsim reads DeepSeek's interleaved layout, as SGLang and vLLM do")
    if cfg.num_key_value_heads not in (None, cfg.num_attention_heads):
        raise UsageError(f"{source}: num_key_value_heads={cfg.num_key_value_heads} must equal "
                         f"num_attention_heads={cfg.num_attention_heads} (MLA has no GQA)")
    if cfg.qk_rope_head_dim % 2:
        raise UsageError(f"{source}: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")


def _check_gqa(cfg: ModelConfig, source: str) -> None:
    heads, kv = cfg.num_attention_heads, cfg.kv_heads
    if heads % kv:
        raise UsageError(f"{source}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                         "each KV head serves a whole group of query heads")
    if cfg.head_dim is None and cfg.hidden_size % heads:
        raise UsageError(f"{source}: hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads={heads}; "
                         "give head_dim")
    if cfg.attention_head_dim % 2:
        raise UsageError(f"{source}: head_dim={cfg.attention_head_dim} must be even for RoPE")
    if cfg.family.sinks and len(cfg.layer_types) < cfg.num_hidden_layers:
        raise UsageError(f"{source}: layer_types names {len(cfg.layer_types)} layers, num_hidden_layers is "
                         f"{cfg.num_hidden_layers}; give one type per layer")
    if "sliding_attention" in cfg.layer_types and not cfg.sliding_window:
        raise UsageError(f"{source}: layer_types has sliding_attention layers but sliding_window is "
                         f"{cfg.sliding_window!r}; give the window (GPT-OSS: 128)")
    for flag, what in (("mlp_bias", "MLP biases"), ("use_sliding_window", "sliding-window attention")):
        if cfg.extra.get(flag):
            raise UsageError(f"{source}: {flag}=true ({what}) is not supported for {cfg.model_type}; "
                             "tpsim runs the published configs, which leave it off")


def _check_moe(cfg: ModelConfig, source: str) -> None:
    n = cfg.family.hf_name
    for name in ("num_experts_per_tok", "moe_intermediate_size"):
        if getattr(cfg, name) is None:
            raise UsageError(f"{source}: field {name} is required when {n('n_routed_experts')} is set")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise UsageError(f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                         f"{n('n_routed_experts')}={cfg.n_routed_experts}")
    if cfg.topk_method not in TOPK_METHODS:
        raise UsageError(f"{source}: topk_method={cfg.topk_method!r} is unknown; "
                         f"use one of {', '.join(TOPK_METHODS)}")
    if cfg.scoring_func not in SCORING_FUNCS:
        raise UsageError(f"{source}: scoring_func={cfg.scoring_func!r} is unknown; "
                         f"use one of {', '.join(SCORING_FUNCS)}")
    if cfg.topk_method != "greedy":
        n_group, topk_group = cfg.n_group or 1, cfg.topk_group or 1
        if cfg.n_routed_experts % n_group:
            raise UsageError(f"{source}: n_group={n_group} does not divide "
                             f"n_routed_experts={cfg.n_routed_experts}")
        if topk_group > n_group:
            raise UsageError(f"{source}: topk_group={topk_group} exceeds n_group={n_group}")
        if cfg.num_experts_per_tok > topk_group * (cfg.n_routed_experts // n_group):
            raise UsageError(f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} exceeds the "
                             f"experts in topk_group={topk_group} groups")
        if cfg.topk_method == "noaux_tc" and cfg.n_routed_experts // n_group < 2:
            raise UsageError(f"{source}: noaux_tc scores groups by their top-2 experts; "
                             f"n_routed_experts/n_group must be at least 2")


def _check_rope_scaling(cfg: ModelConfig, source: str) -> None:
    rs = cfg.rope_scaling
    kind = rs.get("type", rs.get("rope_type"))
    allowed = ROPE_TYPES[cfg.family.attention]
    if kind not in allowed:
        raise UsageError(f"{source}: rope_scaling type {kind!r} is not supported for {cfg.model_type}; "
                         f"use {' or '.join(allowed)} or null")
    numbers = LLAMA3_NUMBERS if kind == "llama3" else YARN_NUMBERS
    needs = numbers if kind == "llama3" else numbers[:1] if cfg.mla else numbers[:2]  # DeepSeek's defaults to 4096
    for key in needs:
        if key not in rs:
            raise UsageError(f"{source}: rope_scaling ({kind}) needs {key}")
    for key in numbers:  # the rope maths reads these on every rank: a string or a 0 fails there
        if key not in rs or (key == "mscale_all_dim" and rs[key] is None):
            continue
        v, positive = rs[key], kind == "llama3" or key in YARN_NUMBERS[:4]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise UsageError(f"{source}: rope_scaling {key} must be a {'positive' if positive else 'finite'} "
                             f"number, got {v!r}")
    if kind == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise UsageError(f"{source}: rope_scaling high_freq_factor={rs['high_freq_factor']} must exceed "
                         f"low_freq_factor={rs['low_freq_factor']}")


MAX_TENSOR_ELEMENTS = 2**48  # 1 PB in float32; DeepSeek-V3's largest tensor holds 9.3e8 elements
MAX_ROUTED_EXPERTS = 2**16  # one module per expert: building 10**9 of them (even on the meta device) never ends


def _count(n: int) -> str:
    """`1.23e+20`; an int too large for a float (10**400) as `about 10^400`."""
    return f"{n:.3g}" if n < 1e300 else f"about 10^{len(str(n)) - 1}"


def _check_sizes(cfg: ModelConfig, source: str) -> None:
    """Refuse shapes no machine holds before torch overflows int64 sizing them (a hidden_size of 10**19
    is a traceback from torch.empty even on the meta device)."""
    H, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.mla:
        q, kv = cfg.q_lora_rank, cfg.kv_lora_rank
        attention = [
            (H * heads * cfg.qk_head_dim if q is None else max(H * q, q * heads * cfg.qk_head_dim), "the q projection"),
            (max(H * (kv + cfg.qk_rope_head_dim), kv * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
             "the kv projections"),
            (heads * cfg.v_head_dim * H, "o_proj")]
    else:
        attention = [((heads + 2 * cfg.kv_heads) * cfg.attention_head_dim * H, "the qkv projection")]
    biggest = max([
        (cfg.padded_vocab_size * H, "vocab_size x hidden_size"),
        *attention,
        (cfg.intermediate_size * H, "intermediate_size x hidden_size"),
        ((cfg.moe_intermediate_size or 0) * max(1, cfg.n_shared_experts or 0) * H, "moe_intermediate_size x hidden_size"),
        ((cfg.n_routed_experts or 0) * H, "n_routed_experts x hidden_size"),
    ])
    if biggest[0] > MAX_TENSOR_ELEMENTS:
        raise UsageError(f"{source}: {biggest[1]} makes a tensor of {_count(biggest[0])} elements (at most "
                         f"{MAX_TENSOR_ELEMENTS:.3g}); check the sizes")
    if (cfg.n_routed_experts or 0) > MAX_ROUTED_EXPERTS:
        raise UsageError(f"{source}: {cfg.family.hf_name('n_routed_experts')}={cfg.n_routed_experts} exceeds {MAX_ROUTED_EXPERTS} "
                         "(DeepSeek-V3 has 256); tpsim builds one module per expert")


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
