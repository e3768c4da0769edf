"""Grouped-query attention under TP (Llama, Qwen3, GPT-OSS; vLLM `LlamaAttention`, `Qwen3Attention`): one QKV column-parallel
GEMM split by heads (KV heads replicated when tp > num_key_value_heads), rotary embedding on
whole heads, causal attention on this rank's heads, and a row-parallel o_proj with the block's
one all-reduce. Under context parallelism (`shards`) the rank holds its own tokens only and
all-gathers every token's rotated keys and values (what the KV cache holds) once per layer; after a
cached prefix (tpsim.parallel.context.PrefixCache) it prepends the prefix's, with no collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from tpsim.config.loader import ModelConfig
from tpsim.layers.causal import HeadAttention
from tpsim.layers.fused import region
from tpsim.layers.gptoss import AttentionSinks
from tpsim.layers.linear import QKVParallelLinear, RowParallelLinear
from tpsim.layers.norm import RMSNorm
from tpsim.layers.probe import Point, Probe, point_name
from tpsim.layers.rope import NeoxRotaryEmbedding
from tpsim.parallel.context import Keys
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import S1


@dataclass(frozen=True)
class AttentionShape:
    """What a GQA layer needs of a model's config."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q/k/v biases (Qwen2; Llama's attention_bias also biases o_proj)
    o_proj_bias: bool = False
    qk_norm_eps: float | None = None  # Qwen3: RMSNorm over each q and k head (weights [head_dim]) before rope
    sinks: bool = False  # GPT-OSS: a learned logit per head in the softmax denominator
    window: int | None = None  # GPT-OSS sliding layers: keys a query sees, itself included
    fp8_block: tuple[int, int] | None = None  # q/k/v/o weights kept in FP8 blocks (ModelConfig.fp8_block)

    @classmethod
    def of(cls, cfg: ModelConfig, k: int = 0) -> "AttentionShape":
        """Layer k's attention in a GQA family: `attention_bias` biases q, k, v and o_proj
        (transformers LlamaAttention, Qwen3Attention, GptOssAttention)."""
        return cls(cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.attention_head_dim, cfg.rope_theta,
                   cfg.rope_scaling, cfg.attention_bias, cfg.attention_bias,
                   cfg.rms_norm_eps if cfg.family.qk_norm else None, cfg.family.sinks, cfg.window(k),
                   cfg.fp8_block)


class GQA(HeadAttention):
    """normed hidden `[T, hidden]` Replicate() → `[T, hidden]` Replicate() after o_proj's all-reduce."""

    POINTS = (Point("q", S1, "q_proj output: this rank's query heads (its KV heads are split while tp <= "
                             "num_key_value_heads, replicated beyond)"),
              Point("out", S1, "attention output, this rank's heads: o_proj's input"))

    def __init__(self, shape: AttentionShape, group: TPGroup, prefix: str, dtype: torch.dtype,
                 reduce_results: bool = True, probe: Probe | None = None):
        super().__init__()
        probe = probe or Probe(group)
        s, d = shape, shape.head_dim
        self.qkv_proj = QKVParallelLinear(s.hidden_size, d, s.num_attention_heads, s.num_key_value_heads, group,
                                          f"{prefix}.qkv_proj", dtype, bias=s.attention_bias, fp8=s.fp8_block)
        self.o_proj = RowParallelLinear(s.num_attention_heads * d, s.hidden_size, group, f"{prefix}.o_proj", dtype,
                                        bias=s.o_proj_bias, reduce_results=reduce_results, probe=probe,
                                        fp8=s.fp8_block)
        self.rotary_emb = NeoxRotaryEmbedding(d, s.rope_theta, s.rope_scaling, group.device)
        self.qk_norm = s.qk_norm_eps is not None
        if self.qk_norm:  # one [head_dim] weight shared by every head: replicated, whatever the split
            self.q_norm = RMSNorm(d, s.qk_norm_eps, group, f"{prefix}.q_norm", dtype)
            self.k_norm = RMSNorm(d, s.qk_norm_eps, group, f"{prefix}.k_norm", dtype)
        self.sinks = AttentionSinks(s.num_attention_heads, group, prefix) if s.sinks else None
        self.window = s.window
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.heads, self.qkv_proj.kv_heads, d
        self.group, self.prefix, self.point, self.probe = group, prefix, point_name(prefix), probe

    def forward(self, positions: torch.Tensor, x: torch.Tensor, shards: Keys | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        self.tap("q", q)
        q, k, v = region(self._heads, self.rotary_emb.cos_sin(positions), q, k, v)  # the table outside the region
        if shards is not None:
            k, v = shards.gather(torch.cat([k, v], dim=-1), f"{self.prefix}.kv_gather").chunk(2, dim=-1)
        if self.sinks is not None:
            first = None if shards is None else shards.offset
            return self._project(rearrange(self.sinks(q, k, v, self.window, self.head_dim ** -0.5, first),
                                           "t h d -> t (h d)"))
        # local query head i reads local KV head i // (heads / kv_heads): SDPA's enable_gqa, bitwise the repeated
        # K and V's result and 0.11 ms a layer faster at 8192 tokens on an H100 (benchmarks/probes/gqa_sdpa.py)
        return self._attend(q, k, v, self.head_dim ** -0.5, shards)

    def _heads(self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[T, heads * d]` → `[T, heads, d]`, q and k normed per head (Qwen3) and rotated: on the compiled
        path one region (fused.region), as eager it was a dozen kernels a layer over q and k, 13% of Llama-3.1-8B's
        8192-token forward on an H100 (benchmarks/results/profile-cuda-llama-3.1-8b-8192.json)."""
        q, k, v = (rearrange(t, "t (h d) -> t h d", d=self.head_dim) for t in (q, k, v))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb.rotate(rope, q, k)
        return q, k, v
