"""A decoder of any tpsim family (DeepSeek's MLA, or GQA for Llama and Qwen3; dense MLPs and
MoE) over a TP group, with the fused residual stream of SGLang/vLLM.

A decoder layer returns `(hidden_states, residual)`; `hidden_states + residual` at the
start of layer k+1 is `out(k)`. Before layer 0 the residual is None. The communication mode
(tpsim.modes) declares where that stream and each layer's activations live, stage by stage,
and moves them between stages; the layers tap their named points through the model's Probe.

Under pipeline parallelism (tpsim.parallel.pipeline) a model holds one PP stage: its decoder
layers (keeping their global index k, so their seeded weights are the full model's), the
embedding on the first stage, the final norm and LM head on the last; a stage other than the
first receives (hidden, residual) from the previous stage and one other than the last sends
them on, with real point-to-point send/recv.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from tpsim.base.errors import UsageError
from tpsim.config.loader import ModelConfig
from tpsim.layers import GQA, MLA, AttentionShape, DenseMLP, MoE, ParallelLMHead, RMSNorm, VocabParallelEmbedding
from tpsim.config.families import MoeBlock
from tpsim.layers.fused import EAGER_POLICY, KernelPolicy, forward_kernels
from tpsim.layers.gptoss import GptOssMoE
from tpsim.layers.linear import RowParallelLinear
from tpsim.layers.probe import NamedPoint, Point, Probe, Sink, Tapped
from tpsim.modes import Mode, Stages, Stream, TensorParallel, split_sizes
from tpsim.model.overlap import Earlier, two_batch_overlap
from tpsim.parallel.context import CachedKeys, PrefixCache
from tpsim.parallel.group import TPGroup
from tpsim.parallel.pipeline import Stage
from tpsim.parallel.placement import P, R, Placement

__all__ = ["CausalLM", "DecoderLayer", "DecoderModel", "layer_kinds", "shard_bytes", "split_sizes"]


def own_tokens_view(mode: Mode, group: TPGroup, probe: Probe, local: bool | None = None) -> tuple[TPGroup, Probe]:
    """The group and probe of the layers that a rank-local or context-parallel mode runs whole on each
    rank's own tokens (embedding, attention; the head when `local`, default mode.rank_local), else the
    model's."""
    local = mode.own_token_layers if local is None else local
    return (group.local_view(), probe.own_tokens()) if local else (group, probe)


def add_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor, in_place: bool):
    """The fused add-RMSNorm: (norm(hidden + residual), hidden + residual). `in_place`: the sum is
    written into `residual`'s storage, as the engines' fused_add_rms_norm kernels do, so a capture
    that kept a reference to the residual sees every later add (tpsim's norms are out of place
    otherwise, so nothing a capture kept can change under it)."""
    hidden, total = norm(hidden, residual)
    if not in_place:
        return hidden, total
    residual.copy_(total)
    return hidden, residual


def moe_class(cfg: ModelConfig) -> type:
    """The MoE block of the config's family (both take `(cfg, group, prefix, dtype, ...)`)."""
    return GptOssMoE if cfg.family.moe_block is MoeBlock.GPT_OSS else MoE


class DecoderLayer(Tapped, nn.Module):
    """One decoder layer and the communication between its stages (the job of SGLang's
    LayerCommunicator): the mode's `Stages` say where each tensor lives, `Stream.move` gets it
    there. Attention and MLP return their outputs as computed (per-rank partial sums, or whole
    rows); the layer completes them and taps them as their module's points."""

    POINTS = (Point("attn.in", R, "input_layernorm(hidden + residual): what attention reads"),
              Point("mid", R, "residual stream between attention and MLP (hidden + residual)"),
              Point("mlp.in", R, "post_attention_layernorm output: what the MLP/MoE reads"),
              Point("out", R, "out({k}) = hidden + residual after layer {k}"))

    def __init__(self, cfg: ModelConfig, k: int, group: TPGroup, dtype: torch.dtype, mode: Mode = TensorParallel(),
                 probe: Probe | None = None):
        super().__init__()
        prefix, eps, probe = f"model.layers.{k}", cfg.rms_norm_eps, probe or Probe(group)
        local, local_probe = own_tokens_view(mode, group, probe)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.input_layernorm", dtype)
        self.self_attn = (MLA(cfg, local, f"{prefix}.self_attn", dtype, reduce_results=False, probe=local_probe)
                          if cfg.mla else GQA(AttentionShape.of(cfg, k), local, f"{prefix}.self_attn", dtype,
                                              reduce_results=False, probe=local_probe))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.post_attention_layernorm",
                                                dtype)
        self.group, self.point, self.prefix, self.k, self.probe = group, f"layers.{k}", prefix, k, probe
        self.is_moe = cfg.is_moe_layer(k)
        mlp_group, mlp_probe = (local, local_probe) if mode.whole_weights else (group, probe)
        self.mlp = (moe_class(cfg)(cfg, mlp_group, f"{prefix}.mlp", dtype, reduce_results=False,
                                   expert_parallel=mode.expert_parallel, probe=mlp_probe) if self.is_moe
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, mlp_group, f"{prefix}.mlp", dtype,
                                  reduce_results=False, probe=mlp_probe, fp8=cfg.fp8_block))

    @classmethod
    def points(cls, cfg: ModelConfig, k: int) -> list[NamedPoint]:
        """Layer k's points, its sublayers' included, in forward order."""
        base = f"layers.{k}"
        mlp = moe_class(cfg) if cfg.is_moe_layer(k) else DenseMLP
        attention = MLA if cfg.mla else GQA
        return (cls.declared(base, "attn.in") + attention.points(f"{base}.attn") + cls.declared(base, "mid", "mlp.in")
                + mlp.points(f"{base}.mlp") + cls.declared(base, "out", k=k))

    @property
    def mlp_output(self) -> Tapped:
        """The module whose points the MLP output is tapped as (the MoE, or the dense down_proj)."""
        return self.mlp if self.is_moe else self.mlp.down_proj

    def forward(self, positions, hidden, residual, stream: Stream, stages: Stages,
                previous: "DecoderLayer | None" = None, micro: Earlier | None = None, cached: CachedKeys | None = None):
        """hidden, residual: this rank's view of the stream at `stages.layer_input` → the same at
        `stages.layer_output`. `previous`: the layer before, whose deferred MLP output this one completes.
        `micro`: under two-batch overlap, this layer's earlier micro-batches (tpsim.model.overlap): the
        rows are one micro-batch, its attention sees theirs, and the capture loop does not hear it.
        `cached`: the rows follow a cached prefix, whose keys attention sees too (tpsim.parallel.context)."""
        move, p = stream.move, self.prefix
        if stages.layer_input is P:  # the previous layer's MLP all-reduce, fused into this norm (ar-fusion)
            hidden = move(hidden, P, stages.middle, reduce=f"{p}.input_layernorm")
            previous.mlp_output.tap("out", hidden, stages.middle)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = add_norm(self.input_layernorm, hidden, residual, self.probe.in_place)
        if micro is None:
            self.probe.in_layer(self.k, residual, stream.rows(stages.middle))
        hidden = move(hidden, stages.middle, stages.attn_input, gather=f"{p}.attn_gather")
        self.tap("attn.in", hidden, stages.attn_input)
        attended = self.self_attn(positions, hidden, cached or stream.shards) if micro is None \
            else micro.attend(self.self_attn, positions, hidden)
        attn_reduce = f"{p}.post_attention_layernorm" if stages.attn_reduce_in_norm else f"{p}.self_attn.o_proj"
        hidden = self._complete(self.self_attn.o_proj, attended, stages.attn_output, stages.middle, stream,
                                reduce=attn_reduce)
        hidden, residual = add_norm(self.post_attention_layernorm, hidden, residual, self.probe.in_place)
        self.tap("mid", residual, stages.middle)
        hidden = move(hidden, stages.middle, stages.mlp_input, gather=f"{p}.mlp_gather")
        self.tap("mlp.in", hidden, stages.mlp_input)
        hidden = self._complete(self.mlp_output, self.mlp(hidden), stages.mlp_output, stages.layer_output, stream,
                                reduce=f"{p}.mlp", gather=f"{p}.mlp_gather")
        residual = move(residual, stages.middle, stages.residual_output)
        self.tap("out", lambda: hidden + residual, stages.layer_output)
        return hidden, residual

    @staticmethod
    def _complete(sub: Tapped, y, src: Placement, dst: Placement, stream: Stream, **callers):
        """A sublayer's output `y` as computed (`src`) → `dst`, tapped as `sub`'s points: a partial
        sum before its reduction and after it (by the next layer when deferred), whole rows as
        computed."""
        if src is not P:  # whole rows (dp-attention's own-token attention): complete already, bias aside
            y = sub.add_bias(y) if isinstance(sub, RowParallelLinear) else y
            sub.tap("out", y, src)
            return stream.move(y, src, dst, **callers)
        sub.tap("partial", y, P)
        y = stream.move(y, P, dst, **callers)
        if dst is not P:
            if isinstance(sub, RowParallelLinear):  # o_proj's bias (Llama attention_bias), once, after the sum
                y = sub.add_bias(y)
            sub.tap("out", y, dst)
        return y


def whole_model(cfg: ModelConfig, group: TPGroup) -> Stage:
    """The one stage of a model without pipeline parallelism: every layer."""
    return Stage(0, 1, 0, cfg.num_hidden_layers, group.size)


class DecoderModel(Tapped, nn.Module):
    POINTS = (Point("final", R, "final norm output = position final"),)

    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype, mode: Mode = TensorParallel(),
                 probe: Probe | None = None, stage: Stage | None = None):
        super().__init__()
        probe = probe or Probe(group)
        stage = stage or whole_model(cfg, group)
        local, local_probe = own_tokens_view(mode, group, probe)
        # the last stage holds the embedding too when the head is tied to it (SGLang's llama.py does the same)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, local, "model.embed_tokens",
                                                   dtype, probe=local_probe) \
            if stage.first or (stage.last and cfg.tie_word_embeddings) else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, k, group, dtype, mode, probe) for k in stage.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, group, "model.norm", dtype) if stage.last else None
        self.config, self.group, self.mode, self.probe, self.point = cfg, group, mode, probe, ""
        self.stage, self.dtype = stage, dtype

    def forward(self, input_ids, positions, stream: Stream | None = None, cached: CachedKeys | None = None):
        """input_ids `[T]` (under dp-attention: this rank's own sequence) → final normed hidden
        `[T, hidden]`, Replicate() (dp-attention: this rank's tokens); on a PP stage other than
        the last: None, after sending (hidden, residual) to the next stage. `stream`: the forward's
        token split when the caller made it (it runs a collective under dp-attention). `cached`: the
        tokens follow a cached prefix (CausalLM.forward)."""
        T = input_ids.shape[0]
        stream = stream or self.mode.stream(T, self.group)
        plan = self.mode.plan(self.config, self.group.size, T)
        st = self.stage
        if stream.length is not None:  # sp: pad to a multiple of tp; causal attention keeps pads out of real rows
            input_ids = torch.cat([input_ids, input_ids.new_zeros(stream.length - T)])
            positions = torch.arange(stream.length, device=input_ids.device)
        if stream.shards is not None:  # context parallel: this rank's own tokens, at their global positions
            input_ids, positions = stream.own_rows(input_ids), stream.own_rows(positions)
        if st.first:
            hidden = stream.move(self.embed_tokens.lookup(input_ids), plan.embed, plan.start,
                                 reduce=self.embed_tokens.prefix)
            self.embed_tokens.tap("out", hidden, plan.start)
            residual = None
        else:
            hidden, residual = self._receive(T)
        where, previous = plan.layers[st.start].layer_input, None
        split = plan.tbo_from  # SGLang's normal_end_layer under two-batch overlap (a whole model: no PP stages)
        end = st.end if split is None else split
        for layer, stages in zip(self.layers[:end - st.start], plan.layers[st.start:end]):
            self.probe.boundary(layer.k, hidden, residual, stream.rows(where))
            hidden, residual = layer(positions, hidden, residual, stream, stages, previous, cached=cached)
            where, previous = stages.layer_output, layer
        if not st.last:
            self._send(hidden, residual)
            return None
        rows = stream.rows(where)
        if split is None:
            self.probe.boundary(st.end, hidden, residual, rows)
        else:  # SGLang's model_forward_maybe_tbo, after (outside) the capture loop
            hidden, residual = two_batch_overlap(self.layers[split - st.start:], plan.layers[split:], positions,
                                                 hidden, residual, stream, self.probe)
        hidden, residual = add_norm(self.norm, hidden, residual, self.probe.in_place)
        if split is None:
            self.probe.in_layer(st.end, residual, rows)
        self.probe.final(hidden, rows)
        hidden = stream.move(hidden, where, plan.final, gather="model.norm")[:T]
        self.tap("final", hidden, plan.final)
        return hidden

    def _send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """(hidden, residual) to this rank's peer on the next stage (SGLang's PPProxyTensors, vLLM's
        IntermediateTensors)."""
        g, st = self.group, self.stage
        peer = st.peer(g.rank, st.index + 1)
        g.send(hidden, peer, "pipeline.hidden_states")
        g.send(residual, peer, "pipeline.residual")

    def _receive(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, st = self.group, self.stage
        peer, shape = st.peer(g.rank, st.index - 1), (T, self.config.hidden_size)
        return (g.recv(shape, self.dtype, peer, "pipeline.hidden_states"),
                g.recv(shape, self.dtype, peer, "pipeline.residual"))


class CausalLM(nn.Module):
    """input_ids `[T]` (identical on every rank; under dp-attention each rank's own sequence)
    → logits `[T, vocab_size]` Replicate() (dp-attention: this rank's tokens).

    Under dp-attention the head is replicated on each rank's own tokens with `dp_lm_head`
    (SGLang --enable-dp-lm-head), else vocab-parallel over the group: every rank's final hidden
    states gathered (SGLang's logits gather: always by all-reduce, SUM_LEN), the logits all-gathered
    along vocab, and this rank's rows kept (tpsim.modes.kinds.DpAttention has the sources). With tied
    embeddings a vocab-parallel head holds its rows of the replicated embedding.

    `probe`: where a capture attaches (`with model.probe.attach(sink):`), hearing every named
    point and the residual stream at every position."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype = torch.float32, mode: Mode = TensorParallel(),
                 stage: Stage | None = None, kernels: KernelPolicy = EAGER_POLICY):
        super().__init__()
        mode.check(cfg, group.size)
        self.kernels = kernels  # this model's: eager, or compiled from kernels.min_tokens tokens on
        self.stage = stage or whole_model(cfg, group)
        self.config, self.group, self.mode, self.probe = cfg, group, mode, Probe(group)
        self.model = DecoderModel(cfg, group, dtype, mode, self.probe, self.stage)
        # context parallel: the head whole on each rank, over every token's gathered final hidden state
        head_group, head_probe = (group.local_view(), self.probe.whole()) if mode.whole_weights else \
            own_tokens_view(mode, group, self.probe, local=mode.local_head)
        self.gathered_head = mode.runs_own_tokens(group.size) and not mode.local_head
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_group, "lm_head", dtype,
                                      tie_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                                      probe=head_probe) if self.stage.last else None

    @staticmethod
    def points(cfg: ModelConfig) -> list[NamedPoint]:
        """Every named point of the model, in forward order (tpsim.capture.points.catalogue)."""
        layers = [p for k in range(cfg.num_hidden_layers) for p in DecoderLayer.points(cfg, k)]
        return (VocabParallelEmbedding.declared("embed") + layers + DecoderModel.declared("")
                + ParallelLMHead.declared(""))

    @torch.no_grad()
    def forward(self, input_ids, positions=None, recorder: Sink | None = None, logits: bool = True,
                cache: PrefixCache | None = None):
        """`recorder`: a capture attached to the probe for this forward only. A PP stage other
        than the last returns None (it sent its stream on). `cache`: SGLang's radix cache: while
        empty, input_ids are the prefix it stores the KV of; after that, the tokens after the prefix,
        at their global positions by default, attending to the stored prefix."""
        cached = None if cache is None else self._cached_keys(cache, input_ids.shape[0])
        if positions is None:
            start = 0 if cached is None else cached.offset
            positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        with self.probe.attach(recorder) if recorder is not None else nullcontext(), \
                forward_kernels(self.kernels, input_ids.shape[0]):
            stream = self.mode.stream(input_ids.shape[0], self.group)
            hidden = self.model(input_ids, positions, stream, cached)
            if not logits or hidden is None:  # hidden None: a PP stage before the last sent its stream on
                return hidden
            if not self.gathered_head:
                return self.lm_head(hidden)
            every = stream.gather(hidden, "lm_head.dp_gather", by_sum=True)  # SGLang: dp_gather_replicate, SUM_LEN
            return stream.own_rows(self.lm_head(every))  # dp_scatter: a local copy

    def _cached_keys(self, cache: PrefixCache, T: int) -> CachedKeys:
        """This forward's keys in `cache` (UsageError where the mode or a PP stage cannot replay it)."""
        refusal = self.mode.prefix_cache_refusal(cache.length)
        if refusal is None and not (self.stage.first and self.stage.last):
            refusal = f"--prefix-cached {cache.length} and --pp together are not replayed; drop one of them"
        if refusal is not None:
            raise UsageError(refusal)
        return cache.keys(T)


def layer_kinds(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(a representative layer index, how many layers are built like it): one dense and one MoE
    kind, counted without looping (L may be huge)."""
    n_moe = cfg.moe_layer_count()
    kinds = [(cfg.first_dense_layer, cfg.num_hidden_layers - n_moe), (cfg.first_moe_layer, n_moe)]
    return [(k, count) for k, count in kinds if count]


def shard_bytes(cfg: ModelConfig, tp: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's parameters at TP=tp (the embedding/head, the norm, and each layer
    kind once, built on the meta device: no memory, and fast even for 61 layers x 256 experts)."""
    group = TPGroup(rank=0, size=tp, device=torch.device("meta"))

    def size(m: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    total = size(VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group, "e", dtype)) * \
        (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size * dtype.itemsize
    return total + sum(count * size(DecoderLayer(cfg, k, group, dtype)) for k, count in layer_kinds(cfg))
