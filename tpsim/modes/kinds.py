"""The five communication modes, one class each: where each stage of a layer lives (`plan`), how
the tokens are split (`stream`), and what follows from them (tpsim.modes has the tables)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tpsim.config import ModelConfig
from tpsim.errors import UsageError
from tpsim.modes.base import TP_STAGES, Mode
from tpsim.modes.stages import Plan, Stages, Stream, split_sizes
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S0

SP_STAGES = Stages(layer_input=S0, attn_input=R, attn_output=P, middle=S0, mlp_input=R, mlp_output=P, layer_output=S0)


@dataclass(frozen=True)
class TensorParallel(Mode):
    """SGLang/vLLM `--tp N`: the stream replicated, two all-reduces per layer."""

    name: str = "tp"
    strategies = ("model-level", "in-layer")
    plain = True


@dataclass(frozen=True)
class ArFusion(Mode):
    """SGLang `--enable-flashinfer-allreduce-fusion`: as tp, but for batches of at most
    fusion_max_tokens tokens a layer's MLP all-reduce runs in the next layer's input_layernorm,
    so between layers each rank holds its own summand plus the residual (Partial(sum))."""

    name: str = "ar-fusion"
    strategies = ("in-layer", "model-level")
    options = ("fusion_max_tokens",)

    def fused(self, tp: int, tokens: int, k: int, num_layers: int) -> bool:
        """SGLang: tp > 1, not the last layer, at most fusion_max_tokens tokens in the batch."""
        return tp > 1 and k < num_layers - 1 and tokens <= self.fusion_max_tokens

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        L = cfg.num_hidden_layers
        layers = tuple(replace(TP_STAGES, layer_input=P if k and self.fused(tp, tokens, k - 1, L) else R,
                               layer_output=P if self.fused(tp, tokens, k, L) else R) for k in range(L))
        return Plan(embed=P, layers=layers, final=R)

    def layers_to_explain(self, k: int, num_layers: int) -> int:
        """Also layer k+1, whose input norm holds layer k's fused all-reduce."""
        return min(num_layers, k + 2)

    def _effect(self, tokens: int, num_layers: int) -> str:
        if tokens <= self.fusion_max_tokens:
            return (f"{tokens} tokens <= --fusion-max-tokens {self.fusion_max_tokens}: the MLP all-reduce of layers "
                    f"0..{num_layers - 2} runs fused in the next layer's input_layernorm")
        return (f"{tokens} tokens > --fusion-max-tokens {self.fusion_max_tokens}: no fusion in this batch "
                "(prefill-sized), every MLP all-reduces in its own layer")


@dataclass(frozen=True)
class SequenceParallel(Mode):
    """Megatron sequence parallelism: the stream token-sharded (T padded to a multiple of tp),
    gathered for attention and MLP, their partial sums reduce-scattered back."""

    name: str = "sp"
    strategies = ("gathered", "local")

    def _split(self, T: int, group: TPGroup) -> Stream:
        n = -(-T // group.size)
        return Stream(group, T, (n,) * group.size, max(0, min(n, T - group.rank * n)), length=n * group.size)

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        if tp == 1:
            return super().plan(cfg, tp, tokens)
        return Plan(embed=P, layers=(SP_STAGES,) * cfg.num_hidden_layers, final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        return ids[:T]  # padding rows dropped

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[str, int]:
        L = cfg.num_hidden_layers
        return {"reduce_scatter": 1 + 2 * L, "all_gather": 2 * L + 2}

    def _effect(self, tokens: int, num_layers: int) -> str:
        return "the residual stream is token-sharded between layers (reduce-scatter / all-gather)"


@dataclass(frozen=True)
class ExpertParallel(Mode):
    """SGLang `--moe-a2a-backend deepep` / `--ep N`: experts whole on their ranks; each rank routes
    its token share through them with all_to_all (an emulation of DeepEP's dispatch/combine
    kernels, same data movement), and the stream stays token-scattered from the first MoE layer on
    (ep_output="scattered", SGLang's DeepEP path: communicator.py's SCATTERED layer output) or the
    MoE output is all-gathered (ep_output="replicated", matches no SGLang path)."""

    name: str = "ep"
    strategies = ("gathered", "local")
    options = ("ep_output",)
    expert_parallel = True

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        super().check(cfg, tp, tokens)
        if cfg.n_routed_experts is None or cfg.moe_layer_count() == 0:
            raise UsageError("--mode ep needs MoE layers and this config has none; use --mode tp")
        if cfg.n_routed_experts % tp:
            experts = cfg.family.hf_name("n_routed_experts")
            raise UsageError(f"--mode ep at --tp {tp}: tp does not divide {experts}="
                             f"{cfg.n_routed_experts} (experts are split whole over ranks); pick a --tp "
                             f"that divides {cfg.n_routed_experts}")

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        moe = [cfg.is_moe_layer(k) for k in range(cfg.num_hidden_layers)]
        first, scattered, layers = moe.index(True), self.ep_output == "scattered", []
        for k in range(cfg.num_hidden_layers):
            into = S0 if scattered and k > first else R
            out = S0 if scattered and k >= first else R
            mlp = (S0, S0) if moe[k] else (R, P)  # experts take this rank's token share
            layers.append(Stages(layer_input=into, attn_input=R, attn_output=P, middle=into, mlp_input=mlp[0],
                                 mlp_output=mlp[1], layer_output=out))
        return Plan(embed=P, layers=tuple(layers), final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        every = [None] * group.size  # each rank routed its own token share
        dist.all_gather_object(every, ids.cpu(), group=group.pg)
        return torch.cat(every).to(ids.device)

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[str, int]:
        L = cfg.num_hidden_layers
        moe = [k for k in range(L) if cfg.is_moe_layer(k)]
        M, D = len(moe), L - len(moe)
        if self.ep_output == "replicated":  # MoE: 3 all_to_all + 1 all_gather of the outputs
            return {"all_reduce": 1 + L + D, "all_to_all": 3 * M, "all_gather": M + 1}
        f = moe[0]  # scattered: layers after f gather for attention and reduce-scatter its output
        after, dense_after = L - f - 1, sum(1 for k in range(f + 1, L) if not cfg.is_moe_layer(k))
        counts = {"all_reduce": 1 + (f + 1) + (D - dense_after), "all_to_all": 3 * M,
                  "all_gather": after + dense_after + 2, "reduce_scatter": after + dense_after}
        return {op: n for op, n in counts.items() if n}

    def _effect(self, tokens: int, num_layers: int) -> str:
        return ("experts split whole over ranks, tokens moved with all_to_all; the MoE output is "
                + ("all-gathered" if self.ep_output == "replicated" else "left token-scattered"))


@dataclass(frozen=True)
class DpAttention(Mode):
    """SGLang `--enable-dp-attention` (DeepSeek-V3 serving): each rank runs its own sequence through
    replicated embedding, attention and head; the MLP/MoE runs over every rank's tokens, gathered
    before it and reduce-scattered back."""

    name: str = "dp-attention"
    strategies = ("local",)
    rank_local = True

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        super().check(cfg, tp, tokens)
        if tokens is not None and tokens < tp:
            raise UsageError(f"--mode dp-attention at --tp {tp} gives each rank its own sequence and needs at "
                             f"least {tp} tokens, got {tokens}; pass more --tokens or a larger --seq-len")

    def own_tokens(self, input_ids: list[int], rank: int, size: int) -> list[int]:
        """Contiguous chunk `rank` of `split_sizes(T, size)`."""
        sizes = split_sizes(len(input_ids), size)
        start = sum(sizes[:rank])
        return input_ids[start:start + sizes[rank]]

    def _split(self, T: int, group: TPGroup) -> Stream:
        """Collective: the ranks exchange their token counts."""
        mine = torch.tensor([T], dtype=torch.long, device=group.device)
        sizes = group.all_gather(mine, "model.dp_token_counts", dim=0).tolist()
        return Stream(group, T, tuple(sizes), T, shared=False)

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        if tp == 1:
            return super().plan(cfg, tp, tokens)
        stages = Stages(layer_input=S0, attn_input=S0, attn_output=S0, middle=S0, mlp_input=R, mlp_output=P,
                        layer_output=S0)
        return Plan(embed=S0, layers=(stages,) * cfg.num_hidden_layers, final=S0)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        sizes = split_sizes(T, group.size)  # the MoE saw every rank's tokens, in rank order
        return ids[sum(sizes[:group.rank]):sum(sizes[:group.rank + 1])]

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[str, int]:
        L = cfg.num_hidden_layers
        return {"all_gather": L + 1, "reduce_scatter": L}

    def _effect(self, tokens: int, num_layers: int) -> str:
        return "each rank runs its own sequence (the tokens split in rank order); MLP/MoE over all ranks"
