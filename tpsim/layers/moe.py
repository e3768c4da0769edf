"""DeepSeek MoE under TP (SGLang `DeepseekV2MoE.forward_normal`).

The gate is replicated, so every rank routes identically. Every rank holds every expert,
each split on its intermediate dimension; routed and shared experts produce partial sums
that are combined (`routed * routed_scaling_factor + shared`) and all-reduced **once**.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.capture.points import P, R, point_name
from tpsim.config import ModelConfig
from tpsim.layers.linear import WeightSpec, _copy
from tpsim.layers.mlp import DenseMLP
from tpsim.parallel.group import TPGroup


class MoEGate(nn.Module):
    """Replicated router: `[T, hidden]` → (weights `[T, k]` float32, expert ids `[T, k]`)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.prefix, self.group = prefix, group
        self.point = point_name(prefix).removesuffix(".gate")
        self.top_k, self.method, self.scoring = cfg.num_experts_per_tok, cfg.topk_method, cfg.scoring_func
        self.n_group, self.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        self.renormalize = cfg.norm_topk_prob
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=dtype, device=group.device),
                                   requires_grad=False)
        self.e_score_correction_bias = None
        self.last_ids: torch.Tensor | None = None  # the experts the last forward picked, for tests and traces
        if self.method == "noaux_tc":  # used for selection only, kept in float32
            self.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32, device=group.device),
                                                        requires_grad=False)

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", tuple(self.weight.shape), lambda t: _copy(self.weight, t[:]))
        if self.e_score_correction_bias is not None:
            yield WeightSpec(f"{self.prefix}.e_score_correction_bias", tuple(self.e_score_correction_bias.shape),
                             lambda t: _copy(self.e_score_correction_bias, t[:]))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        self.group.tap(f"{self.point}.router_logits", logits, R)
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.method != "greedy":
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.max(-1).values if self.method == "group_limited_greedy" \
                else grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)  # from the un-biased scores
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        self.last_ids = ids
        return weights, ids


class MoE(nn.Module):
    """normed hidden `[T, hidden]` Replicate() → `[T, hidden]` Replicate() after one all-reduce."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.group, self.prefix, self.point = group, prefix, point_name(prefix)
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = MoEGate(cfg, group, f"{prefix}.gate", dtype)
        self.experts = nn.ModuleList(
            DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size, group, f"{prefix}.experts.{e}", dtype,
                     reduce_results=False) for e in range(cfg.n_routed_experts))
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           group, f"{prefix}.shared_experts", dtype, reduce_results=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # Partial(): this rank's share
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[token]).float() * weights[token, slot, None]
            routed.index_add_(0, token, y)
        out = (routed * self.routed_scaling_factor).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.group.tap(f"{self.point}.partial", out, P)
        out = self.group.all_reduce(out, self.prefix)
        self.group.tap(f"{self.point}.out", out, R)
        return out
