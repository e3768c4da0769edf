"""`ModelConfig`: one decoder of a tpsim family (tpsim.config.families), under the field names of Hugging
Face's config classes, and what follows from its fields (layer kinds, heads, padded vocabulary).
tpsim.config.loader loads and validates it (tpsim.config.checks)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from tpsim.base.errors import UsageError
from tpsim.config.families import BY_MODEL_TYPE, DEFAULT_MODEL_TYPE, Attention, Family, MoeLayout

VOCAB_PADDING = 64  # SGLang / vLLM DEFAULT_VOCAB_PADDING_SIZE


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
    # not a config.json field: linear weights kept in float8_e4m3fn blocks of this (rows, cols) shape
    # with one float32 scale each (--weights fp8); None: in the model dtype, fp8 checkpoints dequantized
    fp8_block: tuple[int, int] | None = None
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

    def weight_block(self) -> tuple[int, int]:
        """The FP8 block a checkpoint of this config uses (quantization_config.weight_block_size),
        DeepSeek-V3's 128 x 128 where it has none (a seeded model generated in FP8)."""
        block = (self.extra.get("quantization_config") or {}).get("weight_block_size")
        return (int(block[0]), int(block[1])) if block else (128, 128)

    def check_fp8(self, tp: int) -> None:
        """Raise UsageError naming the first tensor-parallel split that cuts an FP8 block: a rank's
        shard must hold whole blocks (its scales are the blocks'), as vLLM's block-FP8 layers require."""
        if self.fp8_block is None or tp == 1:
            return
        bo, bi = self.fp8_block
        dims = []
        if self.mla:
            qk, H = (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0), self.num_attention_heads
            dims += [("q_b_proj/q_proj rows", H * qk, bo), ("kv_b_proj rows", H * ((self.qk_nope_head_dim or 0)
                                                                                 + (self.v_head_dim or 0)), bo),
                     ("o_proj columns", H * (self.v_head_dim or 0), bi)]
        else:
            d = self.attention_head_dim
            dims += [("q_proj rows", self.num_attention_heads * d, bo), ("o_proj columns", self.num_attention_heads * d, bi)]
        if self.first_dense_layer is not None:
            dims += [("gate/up_proj rows", self.intermediate_size, bo), ("down_proj columns", self.intermediate_size, bi)]
        if self.first_moe_layer is not None:
            dims += [("expert gate/up rows", self.moe_intermediate_size, bo),
                     ("expert down_proj columns", self.moe_intermediate_size, bi)]
        for name, size, b in dims:
            if (size // tp) % b:
                raise UsageError(f"--weights fp8 at --tp {tp}: each rank's {name} ({size} / {tp} = {size // tp}) "
                                 f"is not a multiple of the {b}-wide fp8 block, so a shard would split a block; "
                                 "use a smaller --tp or --weights bf16")

    def check_tp(self, tp: int, said: str | None = None) -> None:
        """Raise UsageError naming the first dimension that `tp` does not divide (`said`: how the user gave the
        degree, when not as --tp)."""
        said = said or f"--tp {tp}"
        if tp < 1:
            raise UsageError(f"{said} must be a positive integer")
        dims = [("num_attention_heads", self.num_attention_heads)]
        if self.first_dense_layer is not None:
            dims.append(("intermediate_size", self.intermediate_size))
        if self.first_moe_layer is not None:
            dims.append(("moe_intermediate_size", self.moe_intermediate_size))
        dims.append(("padded vocab_size", self.padded_vocab_size))
        for name, value in dims:
            if value % tp:
                kv, upto = self.kv_heads, min(max(tp, 8), 64)  # a fuzzed --tp 10**18 must not loop for ever
                fits = [t for t in range(1, upto + 1) if all(v % t == 0 for _, v in dims)
                        and (self.mla or kv % t == 0 or t % kv == 0)]
                raise UsageError(f"{said} does not divide {name}={value}; pick a degree that divides it"
                                 f"{' (up to ' + str(upto) + ': ' + ', '.join(map(str, fits)) + ')' if fits else ''}")
        kv = self.kv_heads
        if not self.mla and kv % tp and tp % kv:  # KV heads split (kv % tp == 0) or replicated (tp % kv == 0)
            raise UsageError(f"{said} neither divides nor is a multiple of num_key_value_heads={kv}; "
                             "pick a degree that does one or the other")
