"""The six communication modes, one class each: where each stage of a layer lives (`plan`), how
the tokens are split (`stream`), and what follows from them (tpsim.modes has the tables)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.modes.base import (DEFAULT_DP_PADDING, DEFAULT_FUSION_MAX_TOKENS, DP_LOCAL_TOKENS, DP_PADDINGS, EP_OUTPUTS,
                              TP_STAGES, DpLocalTokens, DpPadding, EpOutput, Mode)
from tpsim.modes.strategy import Strategy
from tpsim.modes.stages import Plan, Stages, Stream, split_sizes
from tpsim.modes.tbo import tbo_split
from tpsim.parallel.context import TokenShards
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R, S0
from tpsim.parallel.ops import Op

def _member(enum, value, option: str, allowed: tuple[str, ...]):
    """`value` as a member of `enum` (the CLI's and JSON's string form accepted)."""
    if isinstance(value, enum):
        return value
    if value not in allowed:
        raise UsageError(f"unknown {option} {value!r}; use one of {', '.join(allowed)}")
    return enum(value)


SP_STAGES = Stages(layer_input=S0, attn_input=R, attn_output=P, middle=S0, mlp_input=R, mlp_output=P, layer_output=S0)


@dataclass(frozen=True)
class TensorParallel(Mode):
    """SGLang/vLLM `--tp N`: the stream replicated, two all-reduces per layer. With `tbo` (SGLang
    --enable-two-batch-overlap, tpsim.modes.tbo) layers first_k_dense_replace..L-1 run the batch as two
    micro-batches, each with its own attention and MLP/MoE all-reduces."""

    tbo: bool = False  # SGLang --enable-two-batch-overlap: layers >= first_k_dense_replace as two micro-batches

    name = "tp"
    strategies = (Strategy.MODEL_LEVEL, Strategy.IN_LAYER, Strategy.IN_LAYER_UNCLONED, Strategy.MICRO_BATCHES)
    plain = True
    prefix_cached = True

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        plan = super().plan(cfg, tp, tokens)
        return replace(plan, tbo_from=cfg.first_k_dense_replace) if self.tbo else plan

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        """Two-batch overlap: each of the L - first_k_dense_replace split layers all-reduces twice per
        micro-batch, 4 instead of 2."""
        if not self.tbo:
            return super().collectives(cfg, tp)
        L, f = cfg.num_hidden_layers, cfg.first_k_dense_replace
        return {Op.ALL_REDUCE: 1 + 2 * f + 4 * (L - f), Op.ALL_GATHER: 1}

    def _effect(self, tokens: int, num_layers: int) -> str | None:
        if not self.tbo:
            return None
        a, b = tbo_split(tokens)
        return (f"two-batch overlap: layers from first_k_dense_replace on run as two micro-batches of {a} and {b} "
                "tokens (SGLang's two-chunk split of one sequence), each all-reducing on its own")


@dataclass(frozen=True)
class ArFusion(Mode):
    """SGLang `--enable-flashinfer-allreduce-fusion`: as tp, but for batches of at most
    fusion_max_tokens tokens a layer's MLP all-reduce runs in the next layer's input_layernorm,
    so between layers each rank holds its own summand plus the residual (Partial(sum))."""

    fusion_max_tokens: int = DEFAULT_FUSION_MAX_TOKENS  # fuse only when T <= this

    name = "ar-fusion"
    strategies = (Strategy.IN_LAYER, Strategy.MODEL_LEVEL, Strategy.IN_LAYER_UNCLONED)
    prefix_cached = True

    def __post_init__(self):
        if self.fusion_max_tokens < 1:
            raise UsageError(f"--fusion-max-tokens {self.fusion_max_tokens} must be at least 1 "
                             f"(SGLang's default is {DEFAULT_FUSION_MAX_TOKENS})")

    def fused(self, tp: int, tokens: int, k: int, num_layers: int) -> bool:
        """SGLang: tp > 1, not the last layer, at most fusion_max_tokens tokens in the batch."""
        return tp > 1 and k < num_layers - 1 and tokens <= self.fusion_max_tokens

    def attention_fused(self, tp: int, tokens: int) -> bool:
        """SGLang fuses the attention all-reduce too, into post_attention_layernorm, on the same
        condition without the last-layer exception (communicator.py's
        `_mlp_input_reduce_output_and_update_and_read_residual` calls
        `apply_flashinfer_allreduce_fusion(hidden_states.shape[0])`: the stored main-branch copy;
        the commit was not returned, so the first release with it is not known). The sum is the
        same; only where it runs changes."""
        return tp > 1 and tokens <= self.fusion_max_tokens

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        L, attn = cfg.num_hidden_layers, self.attention_fused(tp, tokens)
        layers = tuple(replace(TP_STAGES, layer_input=P if k and self.fused(tp, tokens, k - 1, L) else R,
                               layer_output=P if self.fused(tp, tokens, k, L) else R, attn_reduce_in_norm=attn)
                       for k in range(L))
        return Plan(embed=P, layers=layers, final=R)

    def layers_to_explain(self, k: int, num_layers: int) -> int:
        """Also layer k+1, whose input norm holds layer k's fused all-reduce."""
        return min(num_layers, k + 2)

    def _effect(self, tokens: int, num_layers: int) -> str:
        if tokens <= self.fusion_max_tokens:
            return (f"{tokens} tokens <= --fusion-max-tokens {self.fusion_max_tokens}: the MLP all-reduce of layers "
                    f"0..{num_layers - 2} runs fused in the next layer's input_layernorm, and every attention "
                    "all-reduce in its layer's post_attention_layernorm")
        return (f"{tokens} tokens > --fusion-max-tokens {self.fusion_max_tokens}: no fusion in this batch "
                "(prefill-sized), every MLP all-reduces in its own layer")


@dataclass(frozen=True)
class SequenceParallel(Mode):
    """Megatron sequence parallelism: the stream token-sharded (T padded to a multiple of tp),
    gathered for attention and MLP, their partial sums reduce-scattered back."""

    name = "sp"
    strategies = (Strategy.GATHERED, Strategy.LOCAL)

    def _split(self, T: int, group: TPGroup) -> Stream:
        n = -(-T // group.size)
        return Stream(group, T, (n,) * group.size, max(0, min(n, T - group.rank * n)), length=n * group.size)

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        if tp == 1:
            return super().plan(cfg, tp, tokens)
        return Plan(embed=P, layers=(SP_STAGES,) * cfg.num_hidden_layers, final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        return ids[:T]  # padding rows dropped

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        L = cfg.num_hidden_layers
        return {Op.REDUCE_SCATTER: 1 + 2 * L, Op.ALL_GATHER: 2 * L + 2}

    def _effect(self, tokens: int, num_layers: int) -> str:
        return "the residual stream is token-sharded between layers (reduce-scatter / all-gather)"


@dataclass(frozen=True)
class ExpertParallel(Mode):
    """SGLang `--moe-a2a-backend deepep` / `--ep N`: experts whole on their ranks; each rank routes
    its token share through them with all_to_all (an emulation of DeepEP's dispatch/combine
    kernels, same data movement), and the stream stays token-scattered from the first MoE layer on
    (ep_output="scattered", SGLang's DeepEP path: communicator.py's SCATTERED layer output) or the
    MoE output is all-gathered (ep_output="replicated", matches no SGLang path)."""

    ep_output: EpOutput = EpOutput.SCATTERED

    name = "ep"
    strategies = (Strategy.GATHERED, Strategy.LOCAL, Strategy.GATHERED_PAST_HARD_CODED_DENSE)
    expert_parallel = True

    def __post_init__(self):
        object.__setattr__(self, "ep_output", _member(EpOutput, self.ep_output, "--ep-output", EP_OUTPUTS))

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
        first, scattered, layers = moe.index(True), self.ep_output is EpOutput.SCATTERED, []
        for k in range(cfg.num_hidden_layers):
            into = S0 if scattered and k > first else R
            out = S0 if scattered and k >= first else R
            mlp = (S0, S0) if moe[k] else (R, P)  # experts take this rank's token share
            layers.append(Stages(layer_input=into, attn_input=R, attn_output=P, middle=into, mlp_input=mlp[0],
                                 mlp_output=mlp[1], layer_output=out))
        return Plan(embed=P, layers=tuple(layers), final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        every = group.all_gather_object(ids.cpu(), "check.routing_rows")  # each rank routed its own token share
        return torch.cat(every).to(ids.device)

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        L = cfg.num_hidden_layers
        moe = [k for k in range(L) if cfg.is_moe_layer(k)]
        M, D = len(moe), L - len(moe)
        if self.ep_output is EpOutput.REPLICATED:  # MoE: 3 all_to_all + 1 all_gather of the outputs
            return {Op.ALL_REDUCE: 1 + L + D, Op.ALL_TO_ALL: 3 * M, Op.ALL_GATHER: M + 1}
        f = moe[0]  # scattered: layers after f gather for attention and reduce-scatter its output
        after, dense_after = L - f - 1, sum(1 for k in range(f + 1, L) if not cfg.is_moe_layer(k))
        counts = {Op.ALL_REDUCE: 1 + (f + 1) + (D - dense_after), Op.ALL_TO_ALL: 3 * M,
                  Op.ALL_GATHER: after + dense_after + 2, Op.REDUCE_SCATTER: after + dense_after}
        return {op: n for op, n in counts.items() if n}

    def _effect(self, tokens: int, num_layers: int) -> str:
        return ("experts split whole over ranks, tokens moved with all_to_all; the MoE output is "
                + ("all-gathered" if self.ep_output is EpOutput.REPLICATED else "left token-scattered"))


@dataclass(frozen=True)
class DpAttention(Mode):
    """SGLang `--enable-dp-attention` (DeepSeek-V3 serving): each rank runs its own sequence through
    replicated embedding, attention and norms; the MLP/MoE runs tensor-parallel over every rank's
    tokens, gathered before it and handed back after it in one of two ways (`dp_padding`, SGLang's
    `DpPaddingMode`), and the LM head is vocab-parallel over all ranks or replicated (`dp_lm_head`).

    Sources (sgl-project/sglang):
    - python/sglang/srt/layers/dp_attention.py@00161092eb7c: `DpPaddingMode.get_dp_padding_mode` (an
      extend batch over more than one DP rank takes SUM_LEN; otherwise the cheaper of the two,
      MAX_LEN when `sum_len * 2 >= max_len * dp_size`; MAX_LEN is also the default under CUDA graphs),
      `_dp_gather_via_all_reduce`, `_dp_gather_via_all_gather`, `dp_scatter`, `dp_reduce_scatter_tensor`.
    - python/sglang/srt/model_executor/forward_batch_info.py@003bbaf9ab79 (`prepare_mlp_sync_batch`):
      MAX_LEN sets every rank's count to max_len and the buffer to max_len * dp_size rows (and pads the
      rank's inputs to max_len); SUM_LEN's buffer is sum(counts) rows.
    - python/sglang/srt/layers/communicator.py@fd3907ee4618: with attn_tp_size == 1 (tp == dp, tpsim's
      case) `_gather_hidden_states_and_residual` adds the residual, applies post_attention_layernorm on
      the rank's own rows, then `dp_gather_partial`s the normed rows; `_scatter_hidden_states` runs
      `dp_reduce_scatter_tensor` under MAX_LEN (the MLP skipped its all-reduce: `should_use_reduce_scatter`)
      and `dp_scatter` otherwise (the MLP all-reduced itself).
    - python/sglang/srt/layers/logits_processor.py@5993251f1c6c (`LogitsProcessor._get_logits`): without
      `--enable-dp-lm-head` (server_args default False) the hidden states are `dp_gather_replicate`d with
      `LogitsMetadata.dp_padding_mode = SUM_LEN` (always, whatever the MLP's mode), logits computed
      vocab-parallel, `tensor_model_parallel_all_gather`ed along vocab, and `dp_scatter`ed to the rank's
      rows; with it the head is `ParallelLMHead(..., use_attn_tp_group=True)` over the attention-TP
      group, of size 1 when tp == dp: the whole vocabulary on every rank, no collective.

    `dp_local_tokens` PER_REQUEST replays sglang issue #16274 (fixed by PR #16310): each rank places only
    one row per request (tpsim: one, its sequence) in the sum-len MLP gather and takes only that row's MLP
    output back; its other rows get zeros (`dp_scatter`'s fill). #16274 hit SPEC_V2's draft-extend forward
    (the draft's own MLP sync); tpsim replays the same count on the target forward, where the aux hidden
    states are captured.

    What tpsim does not model: SGLang's MAX_LEN pads each rank's inputs to max_len and runs the pad
    rows through attention and the MLP (outputs discarded); tpsim pads the collective buffers alike
    (same shapes and bytes) but computes only real rows. SGLang's logits cover only the tokens whose
    logprobs are needed (the last one per request in a plain prefill); tpsim's cover every token."""

    dp_padding: DpPadding = DEFAULT_DP_PADDING  # how the MLP input is gathered
    dp_lm_head: bool = False  # SGLang --enable-dp-lm-head (head replicated on own tokens), else vocab-parallel
    dp_local_tokens: DpLocalTokens = DpLocalTokens.ALL  # the rows each rank places in the MLP gather

    name = "dp-attention"
    strategies = (Strategy.LOCAL,)
    rank_local = True

    def __post_init__(self):
        object.__setattr__(self, "dp_padding", _member(DpPadding, self.dp_padding, "--dp-padding", DP_PADDINGS))
        object.__setattr__(self, "dp_local_tokens", _member(DpLocalTokens, self.dp_local_tokens, "--dp-local-tokens",
                                                           DP_LOCAL_TOKENS))
        if self.dp_local_tokens is DpLocalTokens.PER_REQUEST and self.dp_padding is DpPadding.MAX_LEN:
            raise UsageError("--dp-local-tokens per-request replays the sum-len gather's local row count; max-len's "
                             "all-gather copies every padded row and reads no dp_local_num_tokens: pass --dp-padding "
                             "sum-len")

    @property
    def local_head(self) -> bool:
        return self.dp_lm_head

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
        """Collective: the ranks exchange their token counts (SGLang all-gathers `global_num_tokens`)."""
        mine = torch.tensor([T], dtype=torch.long, device=group.device)
        sizes = group.all_gather(mine, "model.dp_token_counts", dim=0).tolist()
        return Stream(group, T, tuple(sizes), T, shared=False, by_sum=self.dp_padding is DpPadding.SUM_LEN,
                      placed=self.placed(sizes))

    def gather_shortfall(self, tokens: int, tp: int) -> str | None:
        """Why a rank's MLP saw fewer of its rows than it runs, in one line (None when it saw them all)."""
        sizes = split_sizes(tokens, tp)
        if tp == 1 or self.dp_local_tokens is DpLocalTokens.ALL or max(sizes) <= 1:
            return None
        rows = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
        return (f"DP attention gathered 1 of {rows} rows per rank for the MLP (dp_local_num_tokens = the rank's "
                "logprob token count, one per request, not its rows): the other rows got no MLP output, so their "
                "aux hidden states and logits differ from TP=1 (sglang issue #16274: SPEC_V2 EAGLE accept length "
                "-37% under DP attention; fix: PR #16310 counts every row, --dp-local-tokens all)")

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        if tp == 1:
            return super().plan(cfg, tp, tokens)
        stages = Stages(layer_input=S0, attn_input=S0, attn_output=S0, middle=S0, mlp_input=R, mlp_output=P,
                        layer_output=S0)
        return Plan(embed=S0, layers=(stages,) * cfg.num_hidden_layers, final=S0)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        """This rank's rows of the MoE buffer (every rank's tokens, in rank order); the rows it never
        placed there (`placed`) get -1: the MoE did not see them."""
        sizes, r = split_sizes(T, group.size), group.rank
        placed = self.placed(sizes)
        if placed is None:
            return ids[sum(sizes[:r]):sum(sizes[:r + 1])]
        out = ids.new_full((sizes[r], *ids.shape[1:]), -1)
        out[:placed[r]] = ids[sum(placed[:r]):sum(placed[:r + 1])]
        return out

    def placed(self, sizes: list[int]) -> tuple[int, ...] | None:
        """The rows each rank places in the MLP gather when fewer than its rows (None: all of them)."""
        if self.dp_local_tokens is DpLocalTokens.ALL:
            return None
        return tuple(min(1, n) for n in sizes)  # one request per rank: its logprob count

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        """The token-count all-gather; per layer the MLP's gather and hand-back (max-len: all-gather +
        reduce-scatter; sum-len: two all-reduces); the vocab-parallel head: an all-reduce gathering
        the hidden states (always SUM_LEN) and the all-gather of the logits along vocab."""
        L = cfg.num_hidden_layers
        if self.dp_padding is DpPadding.MAX_LEN:
            counts = {Op.ALL_GATHER: 1 + L, Op.REDUCE_SCATTER: L}
        else:
            counts = {Op.ALL_GATHER: 1, Op.ALL_REDUCE: 2 * L}
        if not self.dp_lm_head:
            counts[Op.ALL_GATHER] += 1
            counts[Op.ALL_REDUCE] = counts.get(Op.ALL_REDUCE, 0) + 1
        return counts

    def collective_bytes(self, cfg: ModelConfig, tp: int, counts: list[int], itemsize: int) -> dict[Op, int]:
        """{op: bytes of this rank's inputs} of one forward at TP=tp > 1 where rank r holds counts[r]
        tokens (every rank the same): max-len moves max(counts) rows per rank into the all-gather and
        max(counts) * tp rows into the reduce-scatter; sum-len all-reduces sum(counts) rows; the token
        counts are one int64; the head all-reduces sum(counts) rows and all-gathers its logits slice."""
        L, H, n, S = cfg.num_hidden_layers, cfg.hidden_size, max(counts), sum(counts)
        if self.dp_padding is DpPadding.MAX_LEN:
            out = {Op.ALL_GATHER: 8 + L * n * H * itemsize, Op.REDUCE_SCATTER: L * tp * n * H * itemsize}
        else:
            out = {Op.ALL_GATHER: 8, Op.ALL_REDUCE: L * 2 * S * H * itemsize}
        if not self.dp_lm_head:
            out[Op.ALL_REDUCE] = out.get(Op.ALL_REDUCE, 0) + S * H * itemsize
            out[Op.ALL_GATHER] += S * (cfg.padded_vocab_size // tp) * itemsize
        return out

    def _effect(self, tokens: int, num_layers: int) -> str:
        gather = ("--dp-padding sum-len: MLP input all-reduced from a zero buffer of every rank's rows, output "
                  "all-reduced, own rows kept" if self.dp_padding is DpPadding.SUM_LEN else
                  "--dp-padding max-len: MLP input all-gathered (rows padded to the longest rank), output "
                  "reduce-scattered")
        head = ("LM head replicated on own tokens (--enable-dp-lm-head)" if self.dp_lm_head else
                "LM head vocab-parallel over all ranks' gathered tokens (SGLang's default)")
        local = ("; --dp-local-tokens per-request: each rank places only its first row in the MLP gather and "
                 "takes only that row's output back (sglang issue #16274)"
                 if self.dp_local_tokens is DpLocalTokens.PER_REQUEST else "")
        return f"each rank runs its own sequence (the tokens split in rank order); {gather}{local}; {head}"


CP_STAGES = Stages(layer_input=S0, attn_input=S0, attn_output=S0, middle=S0, mlp_input=S0, mlp_output=S0,
                   layer_output=S0)


@dataclass(frozen=True)
class ContextParallel(Mode):
    """Context parallelism over the group (`--mode cp --tp N`: the N ranks are the CP group): every
    weight whole on each rank, the sequence split into contiguous token chunks (`split_sizes`), the
    stream token-sharded between layers; attention all-gathers what the KV cache holds (MLA: the normed
    latent and the rotated k_pe; GQA: the rotated keys and the values) once per layer and attends with
    the rank's own queries at their global positions; MLP/MoE, norms and embedding on the rank's own
    tokens; the final norm's output all-gathered for the (replicated) LM head.

    Sources:
    - SGLang, DeepSeek V3.2 (NSA) prefill context parallel, `--enable-nsa-prefill-context-parallel`:
      python/sglang/srt/layers/communicator_nsa_cp.py@0e4030139e27 (`NSACPLayerCommunicator`): every
      layer's input and residual SCATTERED over the CP group, in and out; the MLP reads its input
      SCATTERED or FULL (all-gathered over the CP group, then split back).
      python/sglang/srt/layers/attention/nsa/utils.py@01d0b45364dc: `--nsa-prefill-cp-mode in-seq-split`
      cuts the sequence into 2 * cp blocks and rank r holds blocks r and 2cp-1-r (`prepare_input_dp_with_cp_dsa`,
      zigzag for causal load balance); `continuous-split` puts token i on rank i % cp
      (`nsa_cp_continuous_split_data`); `cp_all_gather_rerange_output` all-gathers the KV cache and the
      model output and restores token order. That the capture loop stores `hidden_states + residual` as it
      stands on the rank (scattered, `local`) is from tpsim's research notes (a secondary source); SGLang's
      own deepseek_v2.py was not read at a commit with NSA prefill CP, and the first release with it is
      not known here.
    - vLLM: vllm/model_executor/models/deepseek_v2.py@002d6073aa03 (`DeepseekV2Model.forward`) all-gathers
      an aux hidden state whose rows are fewer than the positions (`tensor_model_parallel_all_gather(
      aux_hidden_state, 0)`, sliced to the token count) before storing it: `gathered`. In the code the rows
      are short under sequence-parallel MoE (`use_sequence_parallel_moe`); in the review of vllm PR #46973
      the author answered that the gather was "added recently for DCP" ("I think"). vLLM's decode context
      parallel (`--decode-context-parallel-size`) shards the KV cache, not the residual stream, so its
      capture is `tp`'s; tpsim does not model DCP's KV interleave nor its LSE merge.

    What tpsim does not model: SGLang's zigzag and round-robin splits (tpsim's chunks are contiguous; a
    local capture is token-scattered under each, its rows in another order); the MLP FULL path and the
    vocab-parallel LM head (tpsim's cp is pure context parallelism, no tensor parallelism inside)."""

    name = "cp"
    strategies = (Strategy.GATHERED, Strategy.LOCAL)
    whole_weights = True

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        if tokens is not None and tokens < tp:
            raise UsageError(f"--mode cp at --tp {tp} splits the tokens over {tp} ranks and needs at least {tp} "
                             f"tokens, got {tokens}; pass more --tokens or a larger --seq-len, or a smaller --tp")

    def _split(self, T: int, group: TPGroup) -> Stream:
        sizes = tuple(split_sizes(T, group.size))
        return Stream(group, T, sizes, sizes[group.rank], shards=TokenShards(group, sizes))

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        if tp == 1:
            return super().plan(cfg, tp, tokens)
        return Plan(embed=S0, layers=(CP_STAGES,) * cfg.num_hidden_layers, final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        every = group.all_gather_object(ids.cpu(), "check.routing_rows")  # each rank routed its own token chunk
        return torch.cat(every).to(ids.device)

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        """One all-gather of the KV cache's rows per layer, one of the final norm's output."""
        return {Op.ALL_GATHER: cfg.num_hidden_layers + 1}

    def collective_bytes(self, cfg: ModelConfig, tp: int, counts: list[int], itemsize: int) -> dict[Op, int]:
        """{op: bytes of this rank's inputs} where rank r holds counts[r] tokens: rows padded to max(counts);
        per layer the cached row (MLA: kv_lora_rank + qk_rope_head_dim; GQA: 2 * kv_heads * head_dim), then
        the hidden row of the final norm."""
        n, L = max(counts), cfg.num_hidden_layers
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla else 2 * cfg.kv_heads * cfg.attention_head_dim
        return {Op.ALL_GATHER: n * (L * row + cfg.hidden_size) * itemsize}

    def _effect(self, tokens: int, num_layers: int) -> str:
        sizes = "+".join(map(str, split_sizes(tokens, 2)))
        return (f"context parallel: the {tokens} tokens split into contiguous chunks over the ranks (at 2 ranks "
                f"{sizes}), the stream token-sharded between layers, attention all-gathering the KV cache's rows")

    def scattered_fix(self) -> str:
        return ("context parallel keeps the stream token-sharded between layers (SGLang NSA prefill CP: "
                "SCATTERED); fix: all-gather the capture over the CP group before storing it, as vLLM's "
                "deepseek_v2.py does for short rows (--strategy gathered)")
