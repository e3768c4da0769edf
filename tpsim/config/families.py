"""The model families tpsim runs: for each config.json `model_type`, its attention, its MoE
layout, the config fields it has (tpsim's name and the family's Hugging Face name), and the
architecture transformers loads it as.

A family is what an engine's model file implements (SGLang `models/deepseek_v2.py`,
`models/llama.py`, `models/qwen3.py`, `models/qwen3_moe.py`; vLLM the same names), so one
family serves several model_types where the files do (Kimi-K2 runs DeepSeek-V3's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from tpsim.base.errors import UsageError


class Attention(Enum):
    """How a family's attention is built (tpsim.layers.attention.MLA or tpsim.layers.gqa.GQA)."""

    MLA = "multi-head latent attention"  # DeepSeek: q/kv LoRA, one shared rope key
    GQA = "grouped-query attention"  # one QKV GEMM, KV heads shared by groups of query heads


class MoeLayout(Enum):
    """Which decoder layers hold experts (ModelConfig.is_moe_layer)."""

    NONE = "dense"
    DEEPSEEK = "k >= first_k_dense_replace and k % moe_layer_freq == 0"
    QWEN = "k not in mlp_only_layers and (k + 1) % decoder_sparse_step == 0"
    EVERY = "every layer"


class MoeBlock(Enum):
    """What an MoE layer is made of (tpsim.layers.moe.MoE or tpsim.layers.gptoss.GptOssMoE)."""

    ROUTED = "router over softmax or sigmoid scores, SwiGLU experts, optional shared experts"
    GPT_OSS = "biased router (softmax over the top-k logits), biased experts with the clamped SwiGLU"


COMMON = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
          "max_position_embeddings", "tie_word_embeddings")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DEEPSEEK_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "moe_layer_freq", "topk_method", "scoring_func", "n_group", "topk_group",
                "norm_topk_prob", "routed_scaling_factor")
GQA_FIELDS = ("head_dim", "attention_bias")
QWEN_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "decoder_sparse_step", "mlp_only_layers")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: dict[str, str]  # model_type -> the architecture transformers builds for it
    attention: Attention
    moe: MoeLayout
    fields: tuple[str, ...]  # the ModelConfig fields its config.json carries
    required: tuple[str, ...]  # ... of which these must be present (null allowed where the type is optional)
    hf_names: dict[str, str] = field(default_factory=dict)  # tpsim field -> the family's config.json name
    aliases: dict[str, str] = field(default_factory=dict)  # another name a config.json may use -> the HF name
    implied: dict[str, dict] = field(default_factory=dict)  # model_type -> values its model file fixes (a config
    # may leave them out)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope (Qwen3)
    moe_block: MoeBlock = MoeBlock.ROUTED
    sinks: bool = False  # a learned per-head logit in each softmax's denominator (GPT-OSS)
    copies: dict[str, str] = field(default_factory=dict)  # field -> the field whose value it takes
    approximates: str = ""  # non-empty: the real architecture differs in what this says; tpsim runs its shape only

    def hf_name(self, name: str) -> str:
        return self.hf_names.get(name, name)

    def architecture(self, model_type: str) -> str:
        """The transformers class a checkpoint of this family declares; refused for an approximation (a
        checkpoint exported as its architecture would not be one)."""
        if self.approximates:
            raise UsageError(f"model_type {model_type} is an approximation in tpsim ({self.approximates}); it "
                             "replays captures at the model's shape but has no transformers twin: export or compare "
                             "another family")
        return self.model_types[model_type]


DEEPSEEK = Family(
    "deepseek", {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "kimi_k2": "DeepseekV3ForCausalLM"},
    Attention.MLA, MoeLayout.DEEPSEEK, COMMON + MLA_FIELDS + DEEPSEEK_MOE,
    required=("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
              *MLA_FIELDS),
    # transformers' DeepseekV3Config has neither field: V3's router is noaux_tc over sigmoid scores
    implied={"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"},
             "kimi_k2": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}})
LLAMA = Family("llama", {"llama": "LlamaForCausalLM"}, Attention.GQA, MoeLayout.NONE, COMMON + GQA_FIELDS,
               required=("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                         "intermediate_size"))
# Qwen3Config's defaults (head_dim 128, 32 KV heads) are not Llama's: a Qwen config must give both
QWEN3 = Family("qwen3", {"qwen3": "Qwen3ForCausalLM"}, Attention.GQA, MoeLayout.NONE, COMMON + GQA_FIELDS,
               required=(*LLAMA.required, "num_key_value_heads", "head_dim"), qk_norm=True)
QWEN3_MOE = Family(
    "qwen3_moe", {"qwen3_moe": "Qwen3MoeForCausalLM"}, Attention.GQA, MoeLayout.QWEN,
    COMMON + GQA_FIELDS + QWEN_MOE, required=(*QWEN3.required, "n_routed_experts", "num_experts_per_tok",
                                              "moe_intermediate_size"),
    hf_names={"n_routed_experts": "num_experts"}, qk_norm=True,
    # the Hub's configs say num_experts; transformers >= 5 saves num_local_experts (Qwen3MoeConfig.attribute_map)
    aliases={"num_local_experts": "num_experts"},
    # softmax over every expert, top-k, no shared experts, no scaling (transformers Qwen3MoeSparseMoeBlock)
    implied={"qwen3_moe": {"topk_method": "greedy", "scoring_func": "softmax"}})

# GPT-OSS (transformers GptOssConfig): every layer MoE, experts of intermediate_size, attention with sinks,
# sliding-window and full attention alternating by layer_types; its published weights are MXFP4
GPT_OSS = Family(
    "gpt_oss", {"gpt_oss": "GptOssForCausalLM"}, Attention.GQA, MoeLayout.EVERY,
    COMMON + GQA_FIELDS + ("n_routed_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                           "swiglu_limit"),
    required=(*QWEN3.required, "n_routed_experts", "num_experts_per_tok"),
    hf_names={"n_routed_experts": "num_local_experts"}, aliases={"num_experts": "num_local_experts"},
    moe_block=MoeBlock.GPT_OSS, sinks=True, copies={"moe_intermediate_size": "intermediate_size"})

# Qwen3.5 (Qwen3_5ForConditionalGeneration, model_type qwen3_5: the model file vllm PR #36527 found never captured)
# at its published shape: Qwen3's dense decoder at that shape, so a capture replay has the real depth and width.
# What it is not is stated below (and in configs/qwen3.5-9b.yaml).
QWEN3_5 = dataclasses.replace(
    QWEN3, name="qwen3_5", model_types={"qwen3_5": "Qwen3_5ForConditionalGeneration"},
    approximates="every layer runs full GQA attention with rope over the whole head (Qwen3.5 runs Gated DeltaNet "
                 "linear attention in 3 of every 4 layers, gates its attention output and rotates a quarter of each "
                 "head), and the vision tower is left out: the residual stream's positions, depth and width are "
                 "Qwen3.5's, the values are not")

FAMILIES = (DEEPSEEK, LLAMA, QWEN3, QWEN3_MOE, GPT_OSS, QWEN3_5)
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
MODEL_TYPES = tuple(BY_MODEL_TYPE)
DEFAULT_MODEL_TYPE = "deepseek_v2"
