"""DeepSeek MLA attention under TP (non-absorbed path, vLLM `DeepseekV2Attention`).

A-projections and their norms are replicated; q_proj / q_b_proj and kv_b_proj are
column-parallel, which is a clean head split because their outputs are head-major;
o_proj is row-parallel with the block's one all-reduce.

Under context parallelism (`shards`) the rank holds its own tokens only: it all-gathers what the
MLA cache holds, the normed latent and the rotated k_pe, once per layer, up-projects every token's
latent with kv_b_proj, and attends with its own queries. After a cached prefix
(tpsim.parallel.context.PrefixCache) the suffix's latent and k_pe follow the prefix's, with no collective.
"""

from __future__ import annotations

import torch
from einops import rearrange

from tpsim.config.loader import ModelConfig
from tpsim.layers.causal import HeadAttention
from tpsim.layers.fused import kernels, region
from tpsim.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from tpsim.layers.norm import RMSNorm
from tpsim.layers.probe import Point, Probe, point_name
from tpsim.layers.rope import DeepseekRotaryEmbedding, softmax_scale
from tpsim.parallel.context import Keys
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import R, S1


class MLA(HeadAttention):
    """normed hidden `[T, hidden]` Replicate() → `[T, hidden]` Replicate() after o_proj's
    all-reduce, or its Partial() input with `reduce_results=False` (the caller reduces)."""

    POINTS = (Point("q", S1, "q_proj / q_b_proj output: this rank's heads"),
              Point("kv_latent", R, "kv_a_layernorm(compressed kv): the latent every head shares"),
              Point("kv", S1, "kv_b_proj output (k_nope, v): this rank's heads"),
              Point("out", S1, "attention output, this rank's heads: o_proj's input"))

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype, reduce_results: bool = True,
                 probe: Probe | None = None):
        super().__init__()
        probe = probe or Probe(group)
        H, hid = cfg.num_attention_heads, cfg.hidden_size
        self.local_heads = divide(H, group.size, "num_attention_heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim, self.kv_lora_rank = cfg.qk_head_dim, cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank is not None
        fp8 = self.fp8 = cfg.fp8_block
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hid, cfg.q_lora_rank, group, f"{prefix}.q_a_proj", dtype, fp8=fp8)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, group, f"{prefix}.q_a_layernorm", dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * self.qk_dim, group, f"{prefix}.q_b_proj", dtype,
                                                 fp8=fp8)
        else:
            self.q_proj = ColumnParallelLinear(hid, H * self.qk_dim, group, f"{prefix}.q_proj", dtype, fp8=fp8)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hid, cfg.kv_lora_rank + self.rope, group,
                                                   f"{prefix}.kv_a_proj_with_mqa", dtype, fp8=fp8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, group, f"{prefix}.kv_a_layernorm", dtype)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), group,
                                              f"{prefix}.kv_b_proj", dtype, fp8=fp8)
        self.o_proj = RowParallelLinear(H * self.v_dim, hid, group, f"{prefix}.o_proj", dtype,
                                        reduce_results=reduce_results, probe=probe, fp8=fp8)
        self.rotary_emb = DeepseekRotaryEmbedding(self.rope, cfg.rope_theta, cfg.rope_scaling, group.device)
        self.scaling = softmax_scale(self.qk_dim, cfg.rope_scaling)
        self.group, self.prefix, self.point, self.probe = group, prefix, point_name(prefix), probe

    def forward(self, positions: torch.Tensor, x: torch.Tensor, shards: Keys | None = None) -> torch.Tensor:
        rope = self.rotary_emb.cos_sin(positions)  # outside the region: once per forward, not per head and layer
        if shards is None:  # one compiled region (fused.region) unless it holds a collective, fp8 or a listened tap
            whole = not (self.fp8 or self.o_proj.reduce_results or self.probe.listening)
            return region(self._forward, rope, x, eligible=whole)
        return self._forward(rope, x, shards)

    def _forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                 shards: Keys | None = None) -> torch.Tensor:
        h = self.local_heads
        q_in = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        self.tap("q", q_in)
        kv_a, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(kv_a)
        self.tap("kv_latent", latent)
        (k_pe,) = self.rotary_emb.rotate(rope, rearrange(k_pe, "t d -> t 1 d"))  # one k_pe head shared by all
        if shards is not None:
            cache = shards.gather(torch.cat([latent, rearrange(k_pe, "t 1 d -> t d")], dim=-1),
                                  f"{self.prefix}.kv_gather")
            latent, k_pe = cache.split([self.kv_lora_rank, self.rope], dim=-1)
            k_pe = rearrange(k_pe, "t d -> t 1 d")
        kv = self.kv_b_proj(latent)
        self.tap("kv", lambda: kv if shards is None else shards.own(kv))
        kv = rearrange(kv, "t (h d) -> t h d", h=h)
        q, k = kernels().rope_assemble_qk(rearrange(q_in, "t (h d) -> t h d", h=h), k_pe, kv, *rope)  # q's rope rotated
        return self._attend(q, k, kv[..., self.nope:], self.scaling, shards)
