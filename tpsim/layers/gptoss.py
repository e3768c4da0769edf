"""GPT-OSS building blocks under TP: the MoE block (biased router, biased experts with the clamped
SwiGLU) and attention with per-head sinks and an optional sliding window.

MoE (`GptOssMoE`): the router is replicated, so every rank routes identically; every rank holds
every expert with its intermediate dimension split (rank r: [r*I/tp, (r+1)*I/tp) of gate and of
up, and the matching rows of down_proj), so each rank's output is a partial sum that one
all-reduce completes. Under EP (`expert_parallel=True`) rank r holds experts [r*E/tp, (r+1)*E/tp)
whole and moves rows with all-to-all exactly as tpsim's `MoE` does.

Checkpoint tensors (transformers' `GptOssExperts`, `GptOssTopKRouter`, `GptOssAttention`):
`{mlp}.router.weight` [E, hidden], `{mlp}.router.bias` [E],
`{mlp}.experts.gate_up_proj` [E, hidden, 2*I] (gate and up interleaved on the last dim),
`{mlp}.experts.gate_up_proj_bias` [E, 2*I] (interleaved too), `{mlp}.experts.down_proj`
[E, I, hidden], `{mlp}.experts.down_proj_bias` [E, hidden], `{attn}.sinks` [num_attention_heads].
The published MXFP4 checkpoints store `gate_up_proj` and `down_proj` as `_blocks`/`_scales`
pairs: tpsim.weights.mxfp4.Mxfp4Source reads them in the layout above.

Sources: transformers 5.24, transformers/models/gpt_oss/modeling_gpt_oss.py (GptOssExperts,
GptOssTopKRouter, GptOssMLP, eager_attention_forward) and transformers/masking_utils.py
(sliding_window_overlay); vLLM vllm-project/vllm@0025d69bcf08bb1b135103167f0bbc82b9af6e69
vllm/model_executor/models/gpt_oss.py (`GptOssModel.load_weights`: the TP slices of the
interleaved gate_up tensors, down_proj_bias on rank 0 only, sinks split by heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.config.loader import ModelConfig
from tpsim.layers.fused import kernels, top_k_margin
from tpsim.layers.linear import WeightSpec, _copy, divide
from tpsim.layers.moe import MoE, Experts, Routing
from tpsim.layers.probe import NamedPoint, Point, Probe, Tapped, point_name
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S0

SWIGLU_ALPHA = 1.702


@dataclass(frozen=True)
class GptOssMoEShape:
    """What a GPT-OSS MoE block needs of the config (GptOssConfig's field names)."""

    hidden_size: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_limit: float = 7.0
    swiglu_alpha: float = SWIGLU_ALPHA

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "GptOssMoEShape":
        return cls(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                   cfg.swiglu_limit)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    """GPT-OSS's activation: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g = gate
    clamped from above only (transformers `GptOssExperts._apply_gate`)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(Experts):
    """Stacked GPT-OSS experts with biases: `w13` `[E_local, 2*I_local, hidden]` (this rank's gate
    rows then its up rows, de-interleaved at load), `w13_bias` `[E_local, 2*I_local]`, `w2`
    `[E_local, hidden, I_local]`, `w2_bias` `[E_local, hidden]`.

    TP (`shard` = the TP group): all E experts, I_local = I/tp. EP (`first`, `count`, `shard` of
    size 1): experts [first, first+count) whole. `num_experts` is the checkpoint's E.

    down_proj_bias is added once to the sum over ranks: on shard rank 0 only, before the
    all-reduce, per (token, expert) row so it is weighted by the routing weight as in
    transformers' `(h @ down_proj + down_proj_bias) * w`. vLLM does the same (it zeroes w2_bias
    on tp_rank != 0 at load: vllm-project/vllm@0025d69 vllm/model_executor/models/gpt_oss.py).
    Adding it after the all-reduce would need the routing weights there; adding it on every
    rank would count it tp times. Under EP the shard is size 1, so every expert's owner adds it.
    """

    def __init__(self, hidden: int, intermediate: int, first: int, count: int, shard: TPGroup, prefix: str,
                 dtype: torch.dtype, num_experts: int, limit: float = 7.0, alpha: float = SWIGLU_ALPHA):
        super().__init__(hidden, intermediate, first, count, shard, prefix, dtype)
        # torch._grouped_mm on the CPU also wants 16-byte-aligned row strides ("strides should be
        # multiple of 16 bytes" at I_local = 2 in float32), which _grouped_mm_works does not ask there
        self.grouped = self.grouped and all(d * dtype.itemsize % 16 == 0 for d in (hidden, self.local))
        self.num_experts, self.limit, self.alpha = num_experts, limit, alpha
        device = shard.device
        self.w13_bias = nn.Parameter(torch.empty(count, 2 * self.local, dtype=dtype, device=device),
                                     requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(count, hidden, dtype=dtype, device=device), requires_grad=False)

    def weight_specs(self):
        E, H, I, n = self.num_experts, self.hidden, self.intermediate, self.local
        experts = slice(self.first, self.first + self.count)
        # gate j and up j sit at 2j and 2j+1: this rank's slice [r*n, (r+1)*n) of both is the one
        # contiguous range [2*r*n, 2*(r+1)*n), read whole and de-interleaved here (as vLLM slices it)
        cols = slice(2 * self.shard.rank * n, 2 * (self.shard.rank + 1) * n)

        def gate_up(t):
            w = t[experts, :, cols]  # [count, hidden, 2n]
            _copy(self.w13, torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2))

        def gate_up_bias(t):
            b = t[experts, cols]
            _copy(self.w13_bias, torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1))

        rows = slice(self.shard.rank * n, (self.shard.rank + 1) * n)
        yield WeightSpec(f"{self.prefix}.gate_up_proj", (E, H, 2 * I), gate_up)
        yield WeightSpec(f"{self.prefix}.gate_up_proj_bias", (E, 2 * I), gate_up_bias)
        yield WeightSpec(f"{self.prefix}.down_proj", (E, I, H), lambda t: _copy(self.w2, t[experts, rows, :].transpose(1, 2)))
        yield WeightSpec(f"{self.prefix}.down_proj_bias", (E, H), lambda t: _copy(self.w2_bias, t[experts, :]))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """experts `[N]`: the local expert of each of N rows (`x[rows]`, or `x` when `rows` is None)
        → `[N, hidden]`: each row through its expert, down_proj_bias included on shard rank 0
        (this rank's partial sum under TP, the whole output under EP)."""
        order, offs, back = kernels().expert_places(experts, self.count)
        sorted_experts = experts[order]
        xs = x[order if rows is None else rows[order]]
        h = self._mm(xs, self.w13, offs) + self.w13_bias[sorted_experts]
        gate, up = h.chunk(2, dim=-1)
        y = self._mm(clamped_swiglu(gate, up, self.limit, self.alpha), self.w2, offs)
        if self.shard.rank == 0:
            y = y + self.w2_bias[sorted_experts]
        return y[back]


class GptOssRouter(Tapped, nn.Module):
    """Replicated biased router: `[T, hidden]` → (weights `[T, k]` float32, expert ids `[T, k]`,
    margin `[T]`: the k-th minus the (k+1)-th logit).

    As transformers' GptOssTopKRouter: logits = x W^T + b in the model dtype, top-k of the
    logits, then a softmax over the k picked logits (in float32 here; transformers keeps the
    logits' dtype, which is the same thing in float32, and vLLM's fused top-k softmax also
    works in float32). Its point is named under the MoE's."""

    POINTS = (Point("router_logits", R, "router logits (model dtype), replicated router"),)

    def __init__(self, hidden: int, num_experts: int, top_k: int, group: TPGroup, prefix: str, dtype: torch.dtype,
                 probe: Probe | None = None):
        super().__init__()
        self.prefix, self.group, self.probe, self.top_k = prefix, group, probe or Probe(group), top_k
        self.point = point_name(prefix).removesuffix(".router")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=group.device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=group.device), requires_grad=False)
        self.placement = R  # of its input tokens: Shard(dim=0) under EP

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", tuple(self.weight.shape), lambda t: _copy(self.weight, t[:]))
        yield WeightSpec(f"{self.prefix}.bias", tuple(self.bias.shape), lambda t: _copy(self.bias, t[:]))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight, self.bias)
        self.tap("router_logits", logits, self.placement)
        ids, margin = top_k_margin(logits.float(), self.top_k)
        return logits.gather(1, ids).float().softmax(-1), ids, margin


class GptOssMoE(Tapped, nn.Module):
    """normed hidden `[T, hidden]` → sum over the k picked experts of weight * expert(x).

    TP: input Replicate(), output Partial() (`reduce_results=False`, the caller reduces and taps)
    or Replicate() after one all-reduce. EP: input this rank's token shard, output the same
    tokens' full output (Shard(dim=0)), no all-reduce."""

    POINTS = (Point("partial", P, "sum of the routed experts' outputs, before the one all-reduce"),
              Point("out", R, "MoE output after its all-reduce"))

    def __init__(self, shape: "GptOssMoEShape | ModelConfig", group: TPGroup, prefix: str, dtype: torch.dtype,
                 reduce_results: bool = True, expert_parallel: bool = False, probe: Probe | None = None):
        super().__init__()
        probe = probe or Probe(group)
        s = shape if isinstance(shape, GptOssMoEShape) else GptOssMoEShape.from_config(shape)
        self.group, self.prefix, self.point, self.probe = group, prefix, point_name(prefix), probe
        self.reduce_results, self.ep = reduce_results and not expert_parallel, expert_parallel
        self.router = GptOssRouter(s.hidden_size, s.num_local_experts, s.num_experts_per_tok, group,
                                   f"{prefix}.router", dtype, probe)
        self.router.placement = S0 if expert_parallel else R
        E = s.num_local_experts
        first, count, shard = (group.rank * divide(E, group.size, "num_local_experts"), E // group.size,
                               group.local_view()) if expert_parallel else (0, E, group)
        self.experts = GptOssExperts(s.hidden_size, s.intermediate_size, first, count, shard, f"{prefix}.experts",
                                     dtype, E, s.swiglu_limit, s.swiglu_alpha)
        self.routing: Routing | None = None  # the last forward's, for check and the tests

    @classmethod
    def points(cls, base: str) -> list[NamedPoint]:
        """This MoE's points under `base`, its router's first, in forward order."""
        return GptOssRouter.declared(base) + cls.declared(base)

    # MoE's expert dispatch (TP or EP), weighted sum and reduction need only group, prefix, experts,
    # ep and reduce_results, which this block has too
    _ep_experts, _routed, _reduced = MoE._ep_experts, MoE._routed, MoE._reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids, margin = self.router(x)
        self.routing = Routing(ids, margin)
        return self._reduced(self._routed(x, weights, ids))


class AttentionSinks(nn.Module):
    """This rank's sink logits: heads [r*H/tp, (r+1)*H/tp) of `{prefix}.sinks` [H], the query heads
    QKVParallelLinear gives rank r (vLLM narrows the same range). Kept in float32 (`dtype`): the
    softmax is computed in float32, and a bf16 checkpoint's values convert exactly.

    In a GQA layer: `self.sinks = AttentionSinks(heads, group, prefix)` with the attention's own
    prefix (`model.layers.N.self_attn`), then `self.sinks(q, k, v, window)` on `[T, heads, d]`
    tensors of this rank's heads in place of scaled_dot_product_attention."""

    def __init__(self, num_heads: int, group: TPGroup, prefix: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.total, self.group, self.prefix = num_heads, group, prefix
        self.heads = divide(num_heads, group.size, "num_attention_heads")
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=group.device), requires_grad=False)

    def weight_specs(self):
        start = self.group.rank * self.heads
        yield WeightSpec(f"{self.prefix}.sinks", (self.total,),
                         lambda t: _copy(self.sinks, t[start:start + self.heads]))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                scale: float | None = None, first: int | None = None) -> torch.Tensor:
        return kernels().sink_attention(q, k, v, self.sinks, window, scale, first)
