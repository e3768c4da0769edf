"""`Mode`: a communication mode with its options, as one class per mode (tpsim.modes.kinds).

`Mode(name, fusion_max_tokens, ep_output, dp_padding, dp_lm_head, tbo, dp_local_tokens)` builds the
instance of that mode's class; the instance holds plain values only (DpPadding and DpLocalTokens are
Enums of strings), so it pickles to every rank, and `to_dict()` / `from_dict()` round-trip it through JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import ClassVar

import torch

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.modes.stages import Plan, Stages, Stream, split_sizes
from tpsim.modes.tbo import check_tbo
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R
from tpsim.parallel.ops import Op

EP_OUTPUTS = ("replicated", "scattered")
MICRO_BATCHES = "micro-batches"  # the capture strategy of sglang PR #32680 under two-batch overlap


class DpPadding(Enum):
    """How dp-attention gathers every rank's tokens for the MLP/MoE and hands the output back: SGLang's
    `DpPaddingMode` (python/sglang/srt/layers/dp_attention.py, sgl-project/sglang@00161092eb7c).

    MAX_LEN: every rank's rows padded to the longest rank's count, one all-gather
    (`_dp_gather_via_all_gather`) of a `[max_len * tp, hidden]` buffer before the MLP, one
    reduce-scatter after it (`dp_reduce_scatter_tensor`; the MLP skips its all-reduce).
    SUM_LEN: a zero `[sum_len, hidden]` buffer in which each rank writes its rows at its offset, one
    all-reduce (`_dp_gather_via_all_reduce`); the MLP all-reduces its partial sums over the same
    buffer, and each rank copies its own rows back (`dp_scatter`, no collective)."""

    MAX_LEN = "max-len"
    SUM_LEN = "sum-len"


DP_PADDINGS = tuple(p.value for p in DpPadding)


class DpLocalTokens(Enum):
    """How many of its rows a dp-attention rank places in the sum-len MLP gather and takes back from
    it: SGLang's `dp_local_num_tokens` (python/sglang/srt/layers/dp_attention.py@00161092eb7c:
    `get_dp_local_info` reuses the count and start a batch already carries, `_dp_gather_via_all_reduce`
    copies that many rows at that start, `dp_scatter` zero-fills the rank's rows and copies that many back).

    ALL: every row the rank runs (`global_num_tokens`), the right count.
    PER_REQUEST: the rank's logprob token count, one per request, standing in for its rows: sglang
    issue #16274, fixed by PR #16310, where the draft-extend batch of SPEC_V2 EAGLE under DP attention
    carried `num_tokens_for_logprob_per_batch=1`, `LogitsMetadata.compute_dp_attention_metadata` made
    `dp_local_num_tokens` 4 instead of 12, and the MLP sync processed only those rows."""

    ALL = "all"
    PER_REQUEST = "per-request"


DP_LOCAL_TOKENS = tuple(t.value for t in DpLocalTokens)
# SGLang's choice for an extend (prefill) batch over more than one DP rank (`get_dp_padding_mode`:
# `is_extend_in_batch and gather_width > 1` -> SUM_LEN); tpsim's batch is one prefill
DEFAULT_DP_PADDING = DpPadding.SUM_LEN
DEFAULT_FUSION_MAX_TOKENS = 2048  # SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE
_KINDS: dict[str, type["Mode"]] = {}  # name -> class, in the order the classes are defined

TP_STAGES = Stages(layer_input=R, attn_input=R, attn_output=P, middle=R, mlp_input=R, mlp_output=P, layer_output=R)


@dataclass(frozen=True)
class Mode:
    """A communication mode and its options (plain values: it travels to every rank).

    A subclass per mode declares its capture `strategies` (the right one first), which option
    fields it reads, and overrides the methods where it differs from pure TP: its `plan` (the
    placement of every stage), its token split (`stream`), and what follows from them."""

    name: str = "tp"
    fusion_max_tokens: int = DEFAULT_FUSION_MAX_TOKENS  # ar-fusion: fuse only when T <= this
    ep_output: str = "scattered"  # ep: the stream left token-scattered (SGLang DeepEP), or the MoE output all-gathered
    dp_padding: DpPadding = DEFAULT_DP_PADDING  # dp-attention: how the MLP input is gathered (DpPadding)
    dp_lm_head: bool = False  # dp-attention: SGLang --enable-dp-lm-head (head replicated on own tokens), else vocab-parallel
    tbo: bool = False  # SGLang --enable-two-batch-overlap: layers >= first_k_dense_replace as two micro-batches (tp only)
    dp_local_tokens: DpLocalTokens = DpLocalTokens.ALL  # dp-attention: the rows each rank places in the MLP gather

    strategies: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[str, ...]] = ()  # the option fields this mode reads
    plain: ClassVar[bool] = False  # pure TP: every collective an all-reduce but the head's all-gather
    rank_local: ClassVar[bool] = False  # each rank runs and captures its own tokens, not the whole batch
    expert_parallel: ClassVar[bool] = False  # MoE experts split whole over ranks, tokens moved to them
    context_parallel: ClassVar[bool] = False  # every weight whole on each rank, the tokens split, KV all-gathered

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _KINDS[cls.name] = cls

    def __new__(cls, name: str = "tp", *args, **kwargs):
        # Mode("sp") is a SequenceParallel; unpickling calls a subclass's __new__ with no arguments
        return object.__new__(Mode.kind(name) if cls is Mode else cls)

    def __post_init__(self):
        if self.fusion_max_tokens < 1:
            raise UsageError(f"--fusion-max-tokens {self.fusion_max_tokens} must be at least 1 "
                             f"(SGLang's default is {DEFAULT_FUSION_MAX_TOKENS})")
        if self.ep_output not in EP_OUTPUTS:
            raise UsageError(f"unknown --ep-output {self.ep_output!r}; use one of {', '.join(EP_OUTPUTS)}")
        if not isinstance(self.dp_padding, DpPadding):  # the CLI's and JSON's string form
            if self.dp_padding not in DP_PADDINGS:
                raise UsageError(f"unknown --dp-padding {self.dp_padding!r}; use one of {', '.join(DP_PADDINGS)}")
            object.__setattr__(self, "dp_padding", DpPadding(self.dp_padding))
        if not isinstance(self.dp_local_tokens, DpLocalTokens):
            if self.dp_local_tokens not in DP_LOCAL_TOKENS:
                raise UsageError(f"unknown --dp-local-tokens {self.dp_local_tokens!r}; use one of "
                                 f"{', '.join(DP_LOCAL_TOKENS)}")
            object.__setattr__(self, "dp_local_tokens", DpLocalTokens(self.dp_local_tokens))
        if self.dp_local_tokens is DpLocalTokens.PER_REQUEST and self.dp_padding is DpPadding.MAX_LEN:
            raise UsageError("--dp-local-tokens per-request replays the sum-len gather's local row count; max-len's "
                             "all-gather copies every padded row and reads no dp_local_num_tokens: pass --dp-padding "
                             "sum-len")

    @staticmethod
    def kind(name: str) -> type["Mode"]:
        """The class of mode `name`."""
        if name not in _KINDS:
            raise UsageError(f"unknown --mode {name!r}; use one of {', '.join(_KINDS)}")
        return _KINDS[name]

    @staticmethod
    def uses_option(name: str, option: str) -> bool:
        """Whether mode `name` reads option field `option` (False for an unknown mode)."""
        return name in _KINDS and option in _KINDS[name].options


    @property
    def local_head(self) -> bool:
        """Whether the LM head runs whole on each rank's own tokens (a rank-local mode's replicated head)."""
        return self.rank_local

    @property
    def right_strategy(self) -> str:
        return self.strategies[0]

    def strategy(self, name: str | None) -> str:
        """The capture strategy `name` (None: the right one), checked against this mode."""
        if name is None:
            return self.right_strategy
        if name == MICRO_BATCHES and not self.tbo:
            raise UsageError(f"capture strategy {MICRO_BATCHES!r} captures two-batch overlap's micro-batches "
                             "(sglang PR #32680); give --tbo too")
        if name not in self.strategies:
            raise UsageError(f"capture strategy {name!r} does not exist for --mode {self.name}; "
                             f"use one of {', '.join(self.strategies)}")
        return name

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        """Raise UsageError if this mode cannot run `cfg` at TP=tp (on `tokens` tokens)."""
        cfg.check_tp(tp)
        if self.tbo:
            check_tbo(cfg, self.name, tokens)

    def note(self, strategy: str, tokens: int, num_layers: int) -> str | None:
        """What the mode does to this run's capture, in one line (None for plain tp)."""
        what = self._effect(tokens, num_layers)
        return None if what is None else f"mode {self.name}, capture strategy {strategy}: {what}"

    def _effect(self, tokens: int, num_layers: int) -> str | None:
        return None

    def gather_shortfall(self, tokens: int, tp: int) -> str | None:
        """Why a rank's MLP saw fewer of its rows than it runs, in one line (None: it saw them all)."""
        return None

    def scattered_fix(self) -> str | None:
        """Why this mode leaves a capture token-scattered and how to gather it (None: said by the
        diagnosis alone)."""
        return None

    def layers_to_explain(self, k: int, num_layers: int) -> int:
        """How many layers a run explaining layer k builds: 0..k, and any later layer that runs
        one of layer k's collectives."""
        return k + 1

    def fused(self, tp: int, tokens: int, k: int, num_layers: int) -> bool:
        """Whether layer k's MLP all-reduce is deferred into layer k+1's norm."""
        return False

    @staticmethod
    def token_split(T: int, tp: int) -> list[int]:
        """Contiguous split of T tokens over tp ranks, the first T % tp one longer."""
        return split_sizes(T, tp)

    def own_tokens(self, input_ids: list[int], rank: int, size: int) -> list[int]:
        """The tokens group rank `rank` of `size` feeds the model."""
        return input_ids

    def stream(self, T: int, group: TPGroup) -> Stream:
        """The token split of a forward of T tokens on this rank (at TP=1: all of them)."""
        if group.size == 1:
            return Stream(group, T, (T,), T)
        return self._split(T, group)

    def _split(self, T: int, group: TPGroup) -> Stream:
        sizes = split_sizes(T, group.size)
        return Stream(group, T, tuple(sizes), sizes[group.rank])

    def plan(self, cfg: ModelConfig, tp: int, tokens: int) -> Plan:
        """Where every stage of a forward of `tokens` tokens lives at TP=tp (pure TP here: the
        stream replicated, each sublayer's partial sums all-reduced)."""
        return Plan(embed=P, layers=(TP_STAGES,) * cfg.num_hidden_layers, final=R)

    def routing_rows(self, ids: torch.Tensor, group: TPGroup, T: int) -> torch.Tensor:
        """A MoE layer's routing `[rows, top_k]` on this rank (group size > 1) → the routing of
        the tokens this rank fed, in token order (T: the whole batch's tokens)."""
        return ids

    def collectives(self, cfg: ModelConfig, tp: int) -> dict[Op, int]:
        """{op: count} of one forward (logits included) at TP=tp > 1."""
        return {Op.ALL_REDUCE: 1 + 2 * cfg.num_hidden_layers, Op.ALL_GATHER: 1}

    def to_dict(self) -> dict:
        return {k: v.value if isinstance(v, Enum) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Mode":
        return cls(**d) if d else cls()


def expected_collectives(mode: Mode, cfg: ModelConfig, tp: int) -> dict[Op, int]:
    """{op: count} of one forward (logits included) in `mode` at TP=tp: the formulas of the
    tpsim.modes docstring."""
    return {} if tp == 1 else mode.collectives(cfg, tp)
