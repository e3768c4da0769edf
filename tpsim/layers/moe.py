"""DeepSeek MoE under TP (SGLang `DeepseekV2MoE.forward_normal`) and under EP.

TP: the gate is replicated, so every rank routes identically. Every rank holds every expert,
each split on its intermediate dimension; routed and shared experts produce partial sums
that are combined (`routed * routed_scaling_factor + shared`) and all-reduced **once**.

EP (`expert_parallel=True`, DeepEP-style): rank r holds experts [r*E/tp, (r+1)*E/tp) whole and
the shared experts whole; it routes its own token shard, sends each (token, expert) row to the
expert's rank with `all_to_all_single` (uneven splits), and gets the outputs back the same way.

The routed experts run as two grouped GEMMs over rows sorted by expert (`torch._grouped_mm`
with device-side offsets: no loop over experts, no host sync) where the dtype and device allow,
else one GEMM per expert. Compiled on a Hopper GPU with Triton, the first (the gather into expert
order, gate/up and silu * up) is one Triton kernel (`fused.expert_gate_up_fast`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.config.loader import ModelConfig
from tpsim.layers.fused import expert_groups, inverse_permutation, kernels, region, top_k_margin
from tpsim.layers import fp8
from tpsim.layers.fp8 import BlockFp8
from tpsim.layers.linear import WeightSpec, _copy, divide, fp8_parameters
from tpsim.layers.mlp import DenseMLP
from tpsim.layers.probe import NamedPoint, Point, Probe, Tapped, point_name
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S0


@dataclass
class Routing:
    """What a MoE block's router picked in its last forward: the experts `[T, k]` and each token's
    margin `[T]` (how far its pick was from another pick: a flip within it is a near-tie)."""

    ids: torch.Tensor
    margin: torch.Tensor

    @classmethod
    def cat(cls, parts: list["Routing"]) -> "Routing":
        """The routing of consecutive token ranges (two-batch overlap's micro-batches) as one."""
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.margin for p in parts]))


class MoEGate(Tapped, nn.Module):
    """Replicated router: `[T, hidden]` → (weights `[T, k]` float32, expert ids `[T, k]`, margin
    `[T]`: how far each token's pick was from another pick). Its point is named under the MoE's."""

    POINTS = (Point("router_logits", R, "router logits (float32), replicated gate"),)

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype, probe: Probe | None = None):
        super().__init__()
        self.prefix, self.group, self.probe = prefix, group, probe or Probe(group)
        self.point = point_name(prefix).removesuffix(".gate")
        self.top_k, self.method, self.scoring = cfg.num_experts_per_tok, cfg.topk_method, cfg.scoring_func
        self.n_group, self.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        self.renormalize = cfg.norm_topk_prob
        E = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=dtype, device=group.device),
                                   requires_grad=False)
        self.e_score_correction_bias = None
        self.placement = R  # of its input tokens: Shard(dim=0) under EP
        if self.method == "noaux_tc":  # used for selection only, kept in float32
            self.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32, device=group.device),
                                                        requires_grad=False)

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", tuple(self.weight.shape), lambda t: _copy(self.weight, t[:]))
        if self.e_score_correction_bias is not None:
            yield WeightSpec(f"{self.prefix}.e_score_correction_bias", tuple(self.e_score_correction_bias.shape),
                             lambda t: _copy(self.e_score_correction_bias, t[:]))

    def forward(self, x: torch.Tensor):
        logits = kernels().router_logits(x, self.weight)
        self.tap("router_logits", logits, self.placement)
        if self.method == "greedy" and self.e_score_correction_bias is None:
            weights, ids, margin = kernels().greedy_top(logits, self.top_k, self.scoring == "softmax")
        else:
            weights, ids, margin = self._grouped_pick(logits)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, ids, margin

    def _grouped_pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, ids, margin) of the group-limited methods and of any router with a selection bias: the
        experts picked from the biased scores within the best groups, weighted by the un-biased ones."""
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.method != "greedy":
            grouped = choice.view(logits.shape[0], self.n_group, choice.shape[-1] // self.n_group)  # T may be 0 (EP)
            group_scores = grouped.max(-1).values if self.method == "group_limited_greedy" \
                else grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            picked, group_margin = top_k_margin(group_scores, self.topk_group)
            keep.scatter_(1, picked, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        else:
            group_margin = None
        ids, margin = top_k_margin(choice, self.top_k)
        margin = margin if group_margin is None else torch.minimum(margin, group_margin)
        return scores.gather(1, ids), ids, margin  # weights from the un-biased scores


class Experts(nn.Module):
    """Stacked routed experts: `w13` `[E_local, 2*I_local, hidden]` (gate rows then up rows of each
    expert) and `w2` `[E_local, hidden, I_local]`, loaded from the per-expert checkpoint tensors.

    TP (`shard` = the TP group): all E experts, I_local = I/tp (this rank's intermediate slice).
    EP (`first`, `count`): experts [first, first+count), I_local = I (`shard` of size 1).
    """

    def __init__(self, hidden: int, intermediate: int, first: int, count: int, shard: TPGroup, prefix: str,
                 dtype: torch.dtype, fp8: tuple[int, int] | None = None):
        super().__init__()
        self.first, self.count, self.prefix, self.shard = first, count, prefix, shard
        self.hidden, self.intermediate, self.fp8 = hidden, intermediate, fp8
        self.local = divide(intermediate, shard.size, f"{prefix} moe_intermediate_size")
        device = shard.device
        if fp8 is None:
            self.w13 = nn.Parameter(torch.empty(count, 2 * self.local, hidden, dtype=dtype, device=device),
                                    requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(count, hidden, self.local, dtype=dtype, device=device),
                                   requires_grad=False)
        else:  # each stack with its block scales, as two FP8 modules (w13.weight, w2.weight)
            self.gate_up, self.down = nn.Module(), nn.Module()
            fp8_parameters(self.gate_up, (count, 2 * self.local, hidden), fp8, device)
            fp8_parameters(self.down, (count, hidden, self.local), fp8, device)
        self.grouped = fp8 is None and _grouped_mm_works(dtype, device, hidden, self.local)
        self.traceable = self.grouped and dtype == torch.bfloat16  # torch._grouped_mm's meta function: bf16 only

    def _stack(self, which: str) -> "torch.Tensor | BlockFp8":
        """w13 or w2 as the forward multiplies by it (FP8 blocks with their scales, or a tensor)."""
        if self.fp8 is None:
            return getattr(self, which)
        m = self.gate_up if which == "w13" else self.down
        return BlockFp8(m.weight, m.weight_scale_inv, self.fp8)

    def weight_specs(self):
        r, n = self.shard.rank, self.local
        for i in range(self.count):
            name = f"{self.prefix}.{self.first + i}"
            for j, part in enumerate(("gate_proj", "up_proj")):
                yield WeightSpec(f"{name}.{part}.weight", (self.intermediate, self.hidden),
                                 lambda t, i=i, j=j: _copy(self._stack("w13")[i, j * n:(j + 1) * n],
                                                           t[r * n:(r + 1) * n]))
            yield WeightSpec(f"{name}.down_proj.weight", (self.hidden, self.intermediate),
                             lambda t, i=i: _copy(self._stack("w2")[i], t[:, r * n:(r + 1) * n]))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """experts `[N]`: the local expert of each of N rows; the rows are `x[rows]` (`x` itself
        when `rows` is None) → `[N, hidden]`, each row through its expert (this rank's partial
        sum under TP, the whole expert output under EP)."""
        order, offs, back = kernels().expert_places(experts, self.count)
        src = order if rows is None else rows[order]  # where each row in expert order comes from
        if self.fp8 is not None:
            return fp8.experts(x, src, self._stack("w13"), self._stack("w2"), offs)[back]
        if self.grouped:
            h = kernels().expert_gate_up(x, src, self.w13, offs)
        else:
            h = kernels().silu_mul(self._mm(x[src], self._stack("w13"), offs))
        y = self._mm(h, self._stack("w2"), offs)
        return y[back]  # back to row order: a gather (faster than the scatter index_copy_)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows of group e (between offs[e-1] and offs[e]) times w[e]^T."""
        if self.grouped:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if not x.shape[0]:
            return x.new_empty((0, w.shape[1]))
        return torch.cat([F.linear(x[a:b], w[e]) for e, a, b in expert_groups(offs)])


def _counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """`[n]` int64: how many entries of `ids` equal each index (bincount, minus its host sync on CUDA)."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def _grouped_mm_works(dtype: torch.dtype, device: torch.device, *dims: int) -> bool:
    """Whether torch._grouped_mm takes these operands: 16-byte-aligned rows on the CPU (float32
    with moe_intermediate_size / tp = 2 raises "strides should be multiple of 16 bytes"); CUDA
    bf16 with aligned rows on sm90+ (its kernels need both)."""
    if not hasattr(torch, "_grouped_mm") or device.type not in ("cpu", "cuda"):
        return False
    aligned = all(d * dtype.itemsize % 16 == 0 for d in dims)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and aligned and torch.cuda.get_device_capability(device)[0] >= 9
    return aligned


class MoE(Tapped, nn.Module):
    """normed hidden `[T, hidden]` → routed * routed_scaling_factor + shared.

    TP: input Replicate(), output Partial() (`reduce_results=False`) or Replicate() after one
    all-reduce. EP: input this rank's token shard `[t, hidden]` (Shard(dim=0)), output the
    same tokens' full MoE output (Shard(dim=0)); the caller moves tokens. When the MoE does not
    reduce, the caller taps its output points.
    """

    POINTS = (Point("partial", P, "routed * routed_scaling_factor + shared, before the one all-reduce"),
              Point("out", R, "MoE output after its all-reduce"))

    def __init__(self, cfg: ModelConfig, group: TPGroup, prefix: str, dtype: torch.dtype,
                 reduce_results: bool = True, expert_parallel: bool = False, probe: Probe | None = None):
        super().__init__()
        probe = probe or Probe(group)
        self.group, self.prefix, self.point, self.probe = group, prefix, point_name(prefix), probe
        self.reduce_results, self.ep = reduce_results and not expert_parallel, expert_parallel
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.gate = MoEGate(cfg, group, f"{prefix}.gate", dtype, probe)
        self.gate.placement = S0 if expert_parallel else R
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        if expert_parallel:
            per_rank = divide(E, group.size, "n_routed_experts")
            self.experts = Experts(cfg.hidden_size, I, group.rank * per_rank, per_rank, group.local_view(),
                                   f"{prefix}.experts", dtype, cfg.fp8_block)
        else:
            self.experts = Experts(cfg.hidden_size, I, 0, E, group, f"{prefix}.experts", dtype, cfg.fp8_block)
        self.shared_experts = None
        if cfg.n_shared_experts:  # under EP replicated, as SGLang builds them with DeepEP (tp_size=1)
            self.shared_experts = DenseMLP(cfg.hidden_size, I * cfg.n_shared_experts,
                                           group.local_view() if expert_parallel else group,
                                           f"{prefix}.shared_experts", dtype, reduce_results=False, tap_act=False,
                                           probe=probe, fp8=cfg.fp8_block)
        self.routing: Routing | None = None  # the last forward's, for check and the tests

    @classmethod
    def points(cls, base: str) -> list[NamedPoint]:
        """This MoE's points under `base`, its gate's first, in forward order."""
        return MoEGate.declared(base) + cls.declared(base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one compiled region (fused.region) where it traces whole: no collective (EP's all-to-all, the
        # block's own all-reduce), no per-expert loop that reads the offsets on the host (fp8 or
        # ungrouped experts; torch.compile cannot trace a float32 grouped GEMM), no tap listened to
        whole = not (self.ep or self.reduce_results or self.probe.listening) and self.experts.traceable
        out, ids, margin = region(self._forward, x, eligible=whole)
        self.routing = Routing(ids, margin)
        return out

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights, ids, margin = self.gate(x)
        out = self._routed(x, weights * self.routed_scaling_factor, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self._reduced(out), ids, margin

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x `[T, hidden]`, the picked experts `ids` `[T, k]` and their `weights` → sum over each token's
        k experts of weight * expert(x) (TP: this rank's partial sum; EP: computed on the experts' ranks)."""
        k = ids.shape[1]
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)  # one row per (token, slot)
        y = self._ep_experts(x[token], ids.flatten()) if self.ep else self.experts(x, ids.flatten(), token)
        return kernels().weighted_sum(weights, y.view(x.shape[0], k, x.shape[1]))

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output: as computed (`reduce_results=False`: the caller reduces and taps), or
        tapped as the partial sum, all-reduced once, tapped as the output."""
        if not self.reduce_results:
            return out
        self.tap("partial", out)
        out = self.group.all_reduce(out, self.prefix)
        self.tap("out", out)
        return out

    def _ep_experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows `[N, hidden]` with global expert ids `[N]` → each row's expert output, computed on
        the expert's rank: dispatch and combine with all_to_all_single (three per call: the
        per-expert row counts, the rows, the outputs)."""
        group, per_rank = self.group, self.experts.count
        order = ids.argsort(stable=True)  # grouped by expert, hence by destination rank
        counts = _counts(ids, per_rank * group.size)  # [E]: rows I send each expert
        got = group.all_to_all(counts, f"{self.prefix}.dispatch_counts")  # [tp*E_local]: rows each rank sends mine
        send = counts.view(group.size, per_rank).sum(1).tolist()
        recv_by_expert = got.view(group.size, per_rank)
        recv = recv_by_expert.sum(1).tolist()
        received = group.all_to_all(rows[order], f"{self.prefix}.dispatch", recv, send)
        local = torch.arange(per_rank, device=rows.device).repeat(group.size).repeat_interleave(got)
        out = self.experts(received, local)
        back = group.all_to_all(out, f"{self.prefix}.combine", send, recv)
        return back[inverse_permutation(order)]
