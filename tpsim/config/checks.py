"""What a valid model config holds, per family (tpsim.config.families): heads and experts that divide, rope
types per attention, MoE layouts, quantization, and sizes tpsim can build. Every error is one
UsageError naming the field and the fix."""

from __future__ import annotations

import math
from tpsim.config.model import ModelConfig
from tpsim.base.errors import UsageError, quoted
from tpsim.config.families import Attention

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
# rope_scaling fields the YaRN maths reads (the first four must be positive)
YARN_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attn_factor")
YARN_BOOLEANS = ("truncate",)  # GPT-OSS: false keeps the ramp's ends unrounded
LLAMA3_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_TYPES = {Attention.MLA: ("yarn",), Attention.GQA: ("llama3", "yarn")}  # besides none (rope_type default)
LAYER_TYPES = ("sliding_attention", "full_attention")


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


def check_consistency(cfg: ModelConfig, source: str) -> None:
    quant = cfg.extra.get("quantization_config")
    if quant is not None:
        check_quantization_config(quant, source, cfg.model_type)
    if cfg.hidden_act != "silu":
        raise UsageError(f"{source}: hidden_act={cfg.hidden_act!r} is not supported; use silu")
    (_check_mla if cfg.mla else _check_gqa)(cfg, source)
    if cfg.n_routed_experts is not None:
        _check_moe(cfg, source)
    if cfg.rope_scaling is not None:
        check_rope_scaling(cfg.rope_scaling, source, ROPE_TYPES[cfg.family.attention], cfg.model_type, cfg.mla)
    check_rope_theta(cfg.rope_theta, cfg.rope_scaling is not None, source)
    check_rms_norm_eps(cfg.rms_norm_eps, source)
    _check_sizes(cfg, source)


def check_rope_theta(theta: float, scaled: bool, source: str) -> None:
    if theta <= 0 or (theta == 1 and scaled):
        raise UsageError(f"{source}: rope_theta={theta:g} must be positive (and not 1 with rope scaling); write the "
                         "base the model was trained with (Llama 2: 10000.0)")


def check_rms_norm_eps(eps: float, source: str) -> None:
    if eps < 0:
        raise UsageError(f"{source}: rms_norm_eps={eps:g} must not be negative; models use 1e-5 or 1e-6")


def _check_mla(cfg: ModelConfig, source: str) -> None:
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):  # q_lora_rank: null = no LoRA
        if getattr(cfg, name) is None:
            raise UsageError(f"{source}: {name} is null; DeepSeek's MLA attention needs it as a positive integer "
                             f"(e.g. {name}=16)")
    if cfg.extra.get("rope_interleave") is False:
        raise UsageError(f"{source}: rope_interleave=false (NeoX-permuted rope weights) is not supported; "
                         "tpsim reads DeepSeek's interleaved layout, as SGLang and vLLM do")
    if cfg.num_key_value_heads not in (None, cfg.num_attention_heads):
        raise UsageError(f"{source}: num_key_value_heads={cfg.num_key_value_heads} must equal "
                         f"num_attention_heads={cfg.num_attention_heads} (MLA has no GQA)")
    if cfg.qk_rope_head_dim % 2:
        raise UsageError(f"{source}: qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")


def _check_gqa(cfg: ModelConfig, source: str) -> None:
    check_heads(cfg.num_attention_heads, cfg.kv_heads, cfg.hidden_size, cfg.head_dim, source)
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


def check_heads(heads: int, kv: int, hidden: int, head_dim: int | None, source: str) -> None:
    """GQA's heads: KV heads that group the query heads, a head size (`head_dim`, None: hidden // heads) RoPE
    rotates in halves."""
    if heads % kv:
        raise UsageError(f"{source}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                         "give one that does (each KV head serves a whole group of query heads)")
    if head_dim is None and hidden % heads:
        raise UsageError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                         "give head_dim")
    if (head_dim or hidden // heads) % 2:
        raise UsageError(f"{source}: head_dim={head_dim or hidden // heads} must be even for RoPE, which rotates "
                         "pairs; give an even head_dim")


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


def check_rope_scaling(rs: dict, source: str, allowed: tuple[str, ...], what: str, mla: bool = False) -> None:
    """A `rope_scaling` mapping of one of the `allowed` types, with the numbers its maths reads (`what` names
    the model, for the error; `mla`: DeepSeek's, whose original_max_position_embeddings defaults)."""
    kind = rs.get("type", rs.get("rope_type"))
    if kind not in allowed:
        raise UsageError(f"{source}: rope_scaling type {quoted(kind)} is not supported for {what}; "
                         f"use {' or '.join(allowed)} or null")
    numbers = LLAMA3_NUMBERS if kind == "llama3" else YARN_NUMBERS
    needs = numbers if kind == "llama3" else numbers[:1] if mla else numbers[:2]  # DeepSeek's defaults to 4096
    for key in needs:
        if key not in rs:
            raise UsageError(f"{source}: rope_scaling ({kind}) needs {key}; add it to rope_scaling")
    for key in numbers:  # the rope maths reads these on every rank: a string or a 0 fails there
        if key not in rs or (key == "mscale_all_dim" and rs[key] is None):
            continue
        v, positive = rs[key], kind == "llama3" or key in YARN_NUMBERS[:4]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
            raise UsageError(f"{source}: rope_scaling {key} must be a {'positive' if positive else 'finite'} "
                             f"number, got {quoted(v)}; give the value the model was trained with")
    for key in YARN_BOOLEANS if kind == "yarn" else ():  # "false" (a string) would read as true
        if key in rs and not isinstance(rs[key], bool):
            raise UsageError(f"{source}: rope_scaling {key} must be true or false, got {quoted(rs[key])}; "
                             "write true or false, unquoted")
    if kind == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise UsageError(f"{source}: rope_scaling high_freq_factor={rs['high_freq_factor']} must exceed "
                         f"low_freq_factor={rs['low_freq_factor']}; Llama 3.1 has low 1.0 and high 4.0")


MAX_TENSOR_ELEMENTS = 2**48  # 1 PB in float32; DeepSeek-V3's largest tensor holds 9.3e8 elements
MAX_ROUTED_EXPERTS = 2**16  # one module per expert: building 10**9 of them (even on the meta device) never ends


def _count(n: int) -> str:
    """`1.23e+20`; an int too large for a float (10**400) as `about 10^400`."""
    return f"{n:.3g}" if n < 1e300 else f"about 10^{len(str(n)) - 1}"


def check_tensor_sizes(tensors: list[tuple[int, str]], source: str) -> None:
    """Refuse the largest of (elements, what makes it) `tensors` past MAX_TENSOR_ELEMENTS."""
    biggest = max(tensors)
    if biggest[0] > MAX_TENSOR_ELEMENTS:
        raise UsageError(f"{source}: {biggest[1]} makes a tensor of {_count(biggest[0])} elements (at most "
                         f"{MAX_TENSOR_ELEMENTS:.3g}); check the sizes")


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
    check_tensor_sizes([
        (cfg.padded_vocab_size * H, "vocab_size x hidden_size"),
        *attention,
        (cfg.intermediate_size * H, "intermediate_size x hidden_size"),
        ((cfg.moe_intermediate_size or 0) * max(1, cfg.n_shared_experts or 0) * H, "moe_intermediate_size x hidden_size"),
        ((cfg.n_routed_experts or 0) * H, "n_routed_experts x hidden_size"),
    ], source)
    if (cfg.n_routed_experts or 0) > MAX_ROUTED_EXPERTS:
        raise UsageError(f"{source}: {cfg.family.hf_name('n_routed_experts')}={cfg.n_routed_experts} exceeds {MAX_ROUTED_EXPERTS} "
                         "(DeepSeek-V3 has 256); tpsim builds one module per expert")
