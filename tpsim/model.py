"""DeepSeek-V2/V3 decoder over a TP group, with the fused residual stream of SGLang/vLLM.

A decoder layer returns `(hidden_states, residual)`; `hidden_states + residual` at the
start of layer k+1 is `out(k)`. Before layer 0 the residual is None.
"""

from __future__ import annotations

import torch
from torch import nn

from tpsim.capture.points import R
from tpsim.capture.recorder import Recorder
from tpsim.config import ModelConfig
from tpsim.layers import MLA, DenseMLP, MoE, ParallelLMHead, RMSNorm, VocabParallelEmbedding
from tpsim.parallel.group import TPGroup


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, k: int, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        prefix = f"model.layers.{k}"
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.input_layernorm", dtype)
        self.self_attn = MLA(cfg, group, f"{prefix}.self_attn", dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.post_attention_layernorm",
                                                dtype)
        self.group, self.point = group, f"layers.{k}"
        self.mlp = (MoE(cfg, group, f"{prefix}.mlp", dtype) if cfg.is_moe_layer(k)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, group, f"{prefix}.mlp", dtype))

    def forward(self, positions, hidden, residual):
        """hidden, residual `[T, hidden]` Replicate() (residual None at layer 0) → same."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        tap, pt = self.group.tap, self.point
        tap(f"{pt}.attn.in", hidden, R)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        tap(f"{pt}.mid", residual, R)
        tap(f"{pt}.mlp.in", hidden, R)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group, "model.embed_tokens", dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, k, group, dtype) for k in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, group, "model.norm", dtype)
        self.group = group

    def forward(self, input_ids, positions, recorder: Recorder | None = None):
        hidden, residual = self.embed_tokens(input_ids), None
        for k, layer in enumerate(self.layers):
            if recorder is not None:
                recorder.at_boundary(k, hidden, residual)
            hidden, residual = layer(positions, hidden, residual)
            self.group.tap(f"layers.{k}.out", lambda: hidden + residual, R)
        if recorder is not None:
            recorder.at_boundary(len(self.layers), hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        self.group.tap("final", hidden, R)
        if recorder is not None:
            recorder.at_final(hidden)
        return hidden


class DeepseekForCausalLM(nn.Module):
    """input_ids `[T]` (identical on every rank) → logits `[T, vocab_size]` Replicate()."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg.check_tp(group.size)
        self.config, self.group = cfg, group
        self.model = DeepseekModel(cfg, group, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group, "lm_head", dtype,
                                      tie_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    @torch.no_grad()
    def forward(self, input_ids, positions=None, recorder: Recorder | None = None, logits: bool = True):
        if positions is None:
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        hidden = self.model(input_ids, positions, recorder)
        return self.lm_head(hidden) if logits else hidden


def shard_bytes(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's parameters at TP=tp (the embedding/head, the norm, and each layer
    kind once, built on the meta device: no memory, and fast even for 61 layers x 256 experts)."""
    group = TPGroup(rank=0, size=tp, device=torch.device("meta"))

    def size(m: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    total = size(VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group, "e", dtype)) * \
        (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size * dtype.itemsize
    L, n_moe = cfg.num_hidden_layers, cfg.moe_layer_count()  # counted, not looped: L may be huge
    first_moe = -(-cfg.first_k_dense_replace // cfg.moe_layer_freq) * cfg.moe_layer_freq
    first_dense = 0 if not cfg.is_moe_layer(0) else 1  # layer 0 is MoE only when layer 1 is dense or L == n_moe
    for k, count in ((first_moe, n_moe), (first_dense, L - n_moe)):
        if count:
            total += count * size(DecoderLayer(cfg, k, group, dtype))
    return total
