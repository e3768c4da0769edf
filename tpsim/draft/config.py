"""An EAGLE-3 draft's config.json, as the keys SpecForge writes and the engines read (research doc §2.1), or in
the `speculators` format vLLM reads (the layer's keys nested in `transformer_layer_config`, the draft's own at
the top: speculators 0.9.0 `Eagle3SpeculatorConfig.save_pretrained`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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


@dataclass(frozen=True)
class DraftConfig:
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
    def from_json(cls, raw: dict) -> "DraftConfig":
        raw = flat(raw)
        h = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        return cls(
            hidden_size=h, intermediate_size=raw["intermediate_size"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads), head_dim=raw.get("head_dim") or h // heads,
            vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or h, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0), rope_scaling=raw.get("rope_scaling"),
            num_aux=raw.get("num_aux_hidden_states") or (len(ids) if ids else 3), fc_norm=bool(raw.get("fc_norm", False)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            norm_output=bool(raw.get("norm_output", False)),
            aux_layer_ids=tuple(ids) if ids else None,
            nested_norm_before_fc=None if "norm_before_fc" not in eagle else bool(eagle["norm_before_fc"]),
            use_aux_hidden_state=eagle.get("use_aux_hidden_state", True) is not False)

    @property
    def capture_width(self) -> int:
        return self.num_aux * self.target_hidden_size
