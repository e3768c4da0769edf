"""DeepSeek-V2/V3 decoder over a TP group, with the fused residual stream of SGLang/vLLM.

A decoder layer returns `(hidden_states, residual)`; `hidden_states + residual` at the
start of layer k+1 is `out(k)`. Before layer 0 the residual is None. The communication mode
(tpsim.modes) decides where that stream lives and which collectives move it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tpsim.parallel.placement import P, R, S0, Placement
from tpsim.capture.recorder import Recorder
from tpsim.config import ModelConfig
from tpsim.layers import MLA, DenseMLP, MoE, ParallelLMHead, RMSNorm, VocabParallelEmbedding
from tpsim.modes import Mode
from tpsim.parallel.group import TPGroup


@dataclass
class Stream:
    """How this forward's residual stream is laid out, per mode (see tpsim.modes).

    total: real tokens T. sharded: hidden/residual hold this rank's rows only (Shard(dim=0)),
    `sizes[r]` rows on rank r (sp: T padded to a multiple of tp, equal rows; ep: contiguous
    uneven split). real: how many of this rank's rows are real tokens (the rest is sp padding).
    pending: hidden is a per-rank partial sum whose all-reduce is deferred (ar-fusion): the
    name of the point it will complete.
    dp_sizes: under dp-attention, every rank's own token count.
    """

    total: int
    sizes: list[int] = field(default_factory=list)
    real: int = 0
    sharded: bool = False
    pending: str | None = None
    dp_sizes: list[int] | None = None

    @property
    def placement(self) -> Placement:
        if self.pending:
            return P  # hidden + residual: partial sums plus the replicated residual
        return S0 if self.sharded or self.dp_sizes is not None else R


def split_sizes(T: int, n: int) -> list[int]:
    """Contiguous split of T rows over n ranks, the first T % n one row longer."""
    return [T // n + (r < T % n) for r in range(n)]


class DecoderLayer(nn.Module):
    """One decoder layer and the communication its mode does around attention and MLP (the
    job of SGLang's LayerCommunicator). Attention and MLP return per-rank partial sums; the
    layer reduces them: all-reduce (tp), reduce-scatter (sharded stream), deferred into the
    next layer's norm (ar-fusion), or nothing (replicated attention under dp-attention)."""

    def __init__(self, cfg: ModelConfig, k: int, group: TPGroup, dtype: torch.dtype, mode: Mode = Mode()):
        super().__init__()
        prefix = f"model.layers.{k}"
        eps, dp = cfg.rms_norm_eps, mode.name == "dp-attention"
        local = group.local_view() if dp else group  # dp-attention: attention replicated, own tokens
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.input_layernorm", dtype)
        self.self_attn = MLA(cfg, local, f"{prefix}.self_attn", dtype, reduce_results=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, group, f"{prefix}.post_attention_layernorm",
                                                dtype)
        self.group, self.point, self.prefix, self.k, self.mode = group, f"layers.{k}", prefix, k, mode
        self.num_layers, self.is_moe = cfg.num_hidden_layers, cfg.is_moe_layer(k)
        self.mlp = (MoE(cfg, group, f"{prefix}.mlp", dtype, reduce_results=False,
                        expert_parallel=mode.name == "ep") if self.is_moe
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, group, f"{prefix}.mlp", dtype,
                                  reduce_results=False))
        self.mlp_point = f"{self.point}.mlp" if self.is_moe else f"{self.point}.mlp.down_proj"

    def forward(self, positions, hidden, residual, st: Stream, recorder: Recorder | None = None):
        """hidden, residual: this rank's view of the stream (`st`) → the same after this layer."""
        g, tap, pt = self.group, self.group.tap, self.point
        if st.pending:  # ar-fusion: the previous layer's MLP all-reduce, fused into this norm
            hidden = g.all_reduce(hidden, f"{self.prefix}.input_layernorm")
            tap(f"{st.pending}.out", hidden, R)
            st.pending = None
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if recorder is not None:
            recorder.in_layer(self.k, residual, st, g)
        if st.sharded:
            hidden = g.gather_rows(hidden, st.sizes, f"{self.prefix}.attn_gather")
        tap(f"{pt}.attn.in", hidden, S0 if st.dp_sizes is not None else R)
        hidden = self._reduce(self.self_attn(positions, hidden), st, f"{pt}.attn.o_proj",
                              f"{self.prefix}.self_attn.o_proj", st.sizes if st.sharded else None,
                              replicated=st.dp_sizes is not None)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        tap(f"{pt}.mid", residual, st.placement)
        if self.is_moe and self.mode.name == "ep":
            return self._ep_moe(hidden, residual, st)
        sizes = st.dp_sizes or (st.sizes if st.sharded else None)
        if sizes is not None:  # a token-sharded stream: gather the tokens for the MLP
            hidden = g.gather_rows(hidden, sizes, f"{self.prefix}.mlp_gather")
        tap(f"{pt}.mlp.in", hidden, R)
        out = self.mlp(hidden)
        if sizes is None and self.mode.fused(g.size, st.total, self.k, self.num_layers):
            tap(f"{self.mlp_point}.partial", out, P)
            st.pending = self.mlp_point
            return out, residual
        return self._reduce(out, st, self.mlp_point, f"{self.prefix}.mlp", sizes), residual

    def _reduce(self, y, st: Stream, point: str, caller: str, sizes: list[int] | None = None,
                replicated: bool = False):
        """Per-rank partial sums `y` → this mode's stream: reduce-scattered back to each rank's
        `sizes` rows, all-reduced, or (`replicated` weights) already complete."""
        if not replicated:
            self.group.tap(f"{point}.partial", y, P)
            y = self.group.scatter_rows(y, sizes, caller) if sizes is not None else self.group.all_reduce(y, caller)
        self.group.tap(f"{point}.out", y, st.placement)
        return y

    def _ep_moe(self, hidden, residual, st: Stream):
        """ep: route this rank's token shard through experts on their ranks (all_to_all), then
        all-gather the outputs (ep_output=replicated) or keep the stream scattered."""
        g, pt = self.group, self.point
        sizes = split_sizes(st.total, g.size)  # this rank's token share (the scattered stream's own split)
        start = sum(sizes[:g.rank])
        if not st.sharded:
            hidden = hidden[start:start + sizes[g.rank]]
        self.group.tap(f"{pt}.mlp.in", hidden, S0)
        out = self.mlp(hidden)
        if self.mode.ep_output == "replicated":
            return g.gather_rows(out, sizes, f"{self.prefix}.mlp_gather"), residual
        if not st.sharded:
            st.sharded, st.sizes, st.real = True, sizes, sizes[g.rank]
            residual = residual[start:start + sizes[g.rank]]
        return out, residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype, mode: Mode = Mode()):
        super().__init__()
        dp = mode.name == "dp-attention"
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                   group.local_view() if dp else group, "model.embed_tokens", dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, k, group, dtype, mode) for k in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, group, "model.norm", dtype)
        self.group, self.mode = group, mode

    def stream(self, T: int) -> Stream:
        """The stream layout of a forward of T tokens (collective under dp-attention: the ranks
        exchange their token counts)."""
        g = self.group
        if g.size == 1:
            return Stream(T, [T], T)
        if self.mode.name == "sp":
            n = -(-T // g.size)
            return Stream(T, [n] * g.size, max(0, min(n, T - g.rank * n)), sharded=True)
        if self.mode.name == "dp-attention":
            mine = torch.tensor([T], dtype=torch.long, device=g.device)
            sizes = g.all_gather(mine, "model.dp_token_counts", dim=0).tolist()
            return Stream(T, [T], T, dp_sizes=sizes)
        return Stream(T, [T], T)

    def forward(self, input_ids, positions, recorder: Recorder | None = None):
        """input_ids `[T]` (under dp-attention: this rank's own sequence) → final normed hidden
        `[T, hidden]`, Replicate() (dp-attention: this rank's tokens)."""
        g, T = self.group, input_ids.shape[0]
        st = self.stream(T)
        if st.sharded:  # sp: pad to a multiple of tp; causal attention keeps pads out of real rows
            pad = st.sizes[0] * g.size - T
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        hidden, residual = self.embed_tokens(input_ids, st.sizes if st.sharded else None), None
        for k, layer in enumerate(self.layers):
            if recorder is not None:
                recorder.at_boundary(k, hidden, residual, st, g)
            hidden, residual = layer(positions, hidden, residual, st, recorder)
            g.tap(f"layers.{k}.out", lambda: hidden + residual, st.placement)
        if recorder is not None:
            recorder.at_boundary(len(self.layers), hidden, residual, st, g)
        hidden, residual = self.norm(hidden, residual)
        if recorder is not None:
            recorder.in_layer(len(self.layers), residual, st, g)
            recorder.at_final(hidden, st, g)
        if st.sharded:
            hidden = g.gather_rows(hidden, st.sizes, "model.norm")[:T]
        g.tap("final", hidden, S0 if st.dp_sizes is not None else R)
        return hidden


class DeepseekForCausalLM(nn.Module):
    """input_ids `[T]` (identical on every rank; under dp-attention each rank's own sequence)
    → logits `[T, vocab_size]` Replicate() (dp-attention: this rank's tokens)."""

    def __init__(self, cfg: ModelConfig, group: TPGroup, dtype: torch.dtype = torch.float32, mode: Mode = Mode()):
        super().__init__()
        mode.check(cfg, group.size)
        self.config, self.group, self.mode = cfg, group, mode
        self.model = DeepseekModel(cfg, group, dtype, mode)
        head_group = group.local_view() if mode.name == "dp-attention" else group
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_group, "lm_head", dtype,
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
