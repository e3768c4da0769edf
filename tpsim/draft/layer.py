"""`midlayer`: the one Llama decoder layer of an EAGLE-3 draft over cat(input_layernorm(embed), hidden_norm(h)),
embedding first (SpecForge `llama3_eagle.py` LlamaDecoderLayer, EAGLE `cnets.py`, SGLang and vLLM
`llama_eagle3.py`; research doc §2.3 step 4)."""

from __future__ import annotations

import torch
from torch import nn

from tpsim.draft.attention import DraftAttention, DraftCache
from tpsim.draft.config import DraftConfig
from tpsim.layers.mlp import DenseMLP
from tpsim.layers.norm import RMSNorm
from tpsim.parallel.group import TPGroup


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, group: TPGroup, prefix: str, dtype: torch.dtype):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, group, f"{prefix}.hidden_norm", dtype)
        self.input_layernorm = RMSNorm(h, eps, group, f"{prefix}.input_layernorm", dtype)
        self.self_attn = DraftAttention(cfg, group, f"{prefix}.self_attn", dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, group, f"{prefix}.post_attention_layernorm", dtype)
        self.mlp = DenseMLP(h, cfg.intermediate_size, group, f"{prefix}.mlp", dtype)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                cache: DraftCache) -> torch.Tensor:
        """embeds, hidden `[T, H]` → the layer's output `[T, H]`, before the draft's final norm."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(positions, x, cache)
        return h + self.mlp(self.post_attention_layernorm(h))
