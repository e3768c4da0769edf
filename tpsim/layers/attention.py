"""DeepSeek MLA attention under TP (non-absorbed path, vLLM `DeepseekV2Attention`).

A-projections and their norms are replicated; q_proj / q_b_proj and kv_b_proj are
column-parallel, which is a clean head split because their outputs are head-major;
o_proj is row-parallel with the block's one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.capture.points import point_name
from tpsim.parallel.placement import R, S1
from tpsim.config import ModelConfig
from tpsim.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from tpsim.layers.norm import RMSNorm
from tpsim.layers.rope import DeepseekRotaryEmbedding, softmax_scale
from tpsim.parallel.group import TPGroup


class MLA(nn.Module):
    """normed hidden `[T, hidden]` Replicate() → `[T, hidden]` Replicate() after o_proj's
    all-reduce, or its Partial() input with `reduce_results=False` (the caller reduces)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype, reduce_results: bool = True):
        super().__init__()
        H, hid = cfg.num_attention_heads, cfg.hidden_size
        self.local_heads = divide(H, group.size, "num_attention_heads")
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim, self.kv_lora_rank = cfg.qk_head_dim, cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hid, cfg.q_lora_rank, group, f"{prefix}.q_a_proj", dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, group, f"{prefix}.q_a_layernorm", dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, H * self.qk_dim, group, f"{prefix}.q_b_proj", dtype)
        else:
            self.q_proj = ColumnParallelLinear(hid, H * self.qk_dim, group, f"{prefix}.q_proj", dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hid, cfg.kv_lora_rank + self.rope, group,
                                                   f"{prefix}.kv_a_proj_with_mqa", dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, group, f"{prefix}.kv_a_layernorm", dtype)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), group,
                                              f"{prefix}.kv_b_proj", dtype)
        self.o_proj = RowParallelLinear(H * self.v_dim, hid, group, f"{prefix}.o_proj", dtype,
                                        reduce_results=reduce_results)
        self.rotary_emb = DeepseekRotaryEmbedding(self.rope, cfg.rope_theta, cfg.rope_scaling, group.device)
        self.scaling = softmax_scale(self.qk_dim, cfg.rope_scaling)
        self.group, self.point = group, point_name(prefix)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T, h = x.shape[0], self.local_heads
        tap, pt = self.group.tap, self.point
        q_in = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        tap(f"{pt}.q", q_in, S1)
        q_nope, q_pe = q_in.view(T, h, self.qk_dim).split([self.nope, self.rope], dim=-1)
        kv_a, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(kv_a)
        tap(f"{pt}.kv_latent", latent, R)
        kv = self.kv_b_proj(latent)
        tap(f"{pt}.kv", kv, S1)
        kv = kv.view(T, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))  # k_pe: one head shared by all
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(T, h, self.rope)], dim=-1)
        # 4-D [1, h, T, d]: 3-D inputs send CUDA SDPA to its math fallback (30x slower at 8k tokens)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=self.scaling)[0]  # [h, T, v_dim]
        out = out.transpose(0, 1).reshape(T, h * self.v_dim)
        tap(f"{pt}.out", out, S1)
        return self.o_proj(out)
