"""`Mode`: a communication mode, one class per mode (tpsim.modes.kinds), each holding its own
options as fields: `TensorParallel(tbo=True)`, `ArFusion(fusion_max_tokens=6)`,
`ExpertParallel(EpOutput.REPLICATED)`, `DpAttention(DpPadding.MAX_LEN, dp_lm_head=True)`. An
instance holds plain values only (Enums of strings), so it pickles to every rank; `to_dict()` /
`Mode.from_dict()` round-trip it through JSON (one shape for every mode: the reports' `mode` key).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import ClassVar

import torch

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.modes.stages import Plan, Stages, Stream, split_sizes
from tpsim.modes.strategy import Strategy
from tpsim.modes.tbo import check_tbo
from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import P, R
from tpsim.parallel.ops import Op



class EpOutput(Enum):
    """Where ep leaves the stream after a MoE layer: token-scattered (SGLang's DeepEP path,
    communicator.py's SCATTERED layer output) or the MoE output all-gathered (no SGLang path)."""

    REPLICATED = "replicated"
    SCATTERED = "scattered"


EP_OUTPUTS = tuple(o.value for o in EpOutput)


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
# The reports' `mode` object: every mode's options, in this order, each at its default where the
# mode has no such option (the JSON shape predates the per-mode classes)
WIRE_OPTIONS = ("fusion_max_tokens", "ep_output", "dp_padding", "dp_lm_head", "tbo", "dp_local_tokens")

TP_STAGES = Stages(layer_input=R, attn_input=R, attn_output=P, middle=R, mlp_input=R, mlp_output=P, layer_output=R)


@dataclass(frozen=True)
class Mode:
    """A communication mode (plain values: it travels to every rank).

    A subclass per mode declares its `name`, its capture `strategies` (the right one first), its
    options as dataclass fields, and overrides the methods where it differs from pure TP: its
    `plan` (the placement of every stage), its token split (`stream`), and what follows from them."""

    name: ClassVar[str] = ""
    strategies: ClassVar[tuple[Strategy, ...]] = ()
    tbo: ClassVar[bool] = False  # two-batch overlap: a field of TensorParallel, the only mode that has it
    plain: ClassVar[bool] = False  # pure TP: every collective an all-reduce but the head's all-gather
    rank_local: ClassVar[bool] = False  # each rank runs and captures its own tokens, not the whole batch
    expert_parallel: ClassVar[bool] = False  # MoE experts split whole over ranks, tokens moved to them
    whole_weights: ClassVar[bool] = False  # every weight whole on each rank, the tokens split, KV all-gathered (cp)
    prefix_cached: ClassVar[bool] = False  # replays a radix-cache hit (the stream replicated, every row a token)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _KINDS[cls.name] = cls

    @staticmethod
    def kind(name: str) -> type["Mode"]:
        """The class of mode `name`."""
        if name not in _KINDS:
            raise UsageError(f"unknown --mode {name!r}; use one of {', '.join(_KINDS)}")
        return _KINDS[name]

    @staticmethod
    def kinds() -> tuple["type[Mode]", ...]:
        """Every mode's class, in the order they are defined (tpsim.modes.kinds)."""
        return tuple(_KINDS.values())

    @classmethod
    def options(cls) -> tuple[str, ...]:
        """The option fields this mode has."""
        return tuple(f.name for f in fields(cls))

    @staticmethod
    def owner(option: str) -> "type[Mode]":
        """The mode whose option field `option` is."""
        return next(kind for kind in _KINDS.values() if option in kind.options())

    def runs_own_tokens(self, tp: int) -> bool:
        """Whether at TP=tp each rank runs and captures its own tokens, not the whole batch."""
        return self.rank_local and tp > 1

    @property
    def own_token_layers(self) -> bool:
        """Whether the embedding and attention run whole on each rank's own tokens."""
        return self.rank_local or self.whole_weights

    def pipeline_refusal(self, pp: int) -> str | None:
        """Why --pp cannot replay this mode (None: it can)."""
        if not self.plain:
            return f"--pp {pp} runs with --mode tp only, not --mode {self.name}; drop --mode or --pp"
        if self.tbo:
            return (f"--pp {pp} and --tbo together are not replayed (whether SGLang runs two-batch overlap on "
                    "pipeline stages is not known here); drop one of them")
        return None

    def prefix_cache_refusal(self, n: int) -> str | None:
        """Why a forward after a cached prefix of n tokens cannot replay this mode (None: it can)."""
        if not self.prefix_cached:
            return (f"--prefix-cached {n} replays SGLang's radix cache under --mode tp or ar-fusion only, not "
                    f"--mode {self.name}; drop --mode or --prefix-cached")
        if self.tbo:
            return f"--prefix-cached {n} and --tbo together are not replayed; drop one of them"
        return None

    def graphs_refusal(self) -> str | None:
        """The option of this mode a CUDA-graphed batch of every rank's tokens cannot replay (None: none)."""
        if self.tbo:
            return "--tbo"
        return f"--mode {self.name}" if self.own_token_layers else None

    @property
    def local_head(self) -> bool:
        """Whether the LM head runs whole on each rank's own tokens (a rank-local mode's replicated head)."""
        return self.rank_local

    @property
    def right_strategy(self) -> Strategy:
        return self.strategies[0]

    def strategy(self, name: str | None) -> Strategy:
        """The capture strategy named `name` (None: the right one), checked against this mode."""
        if name is None:
            return self.right_strategy
        if name == Strategy.MICRO_BATCHES.value and not self.tbo:
            raise UsageError(f"capture strategy {name!r} captures two-batch overlap's micro-batches "
                             "(sglang PR #32680); give --tbo too")
        if name not in [s.value for s in self.strategies]:
            raise UsageError(f"capture strategy {name!r} does not exist for --mode {self.name}; "
                             f"use one of {', '.join(s.value for s in self.strategies)}")
        return Strategy(name)

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        """Raise UsageError if this mode cannot run `cfg` at TP=tp (on `tokens` tokens)."""
        cfg.check_tp(tp)
        if self.tbo:
            check_tbo(cfg, tokens)

    def note(self, strategy: Strategy, tokens: int, num_layers: int) -> str | None:
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
        own = asdict(self)
        every = {k: own[k] if k in own else Mode.owner(k).__dataclass_fields__[k].default for k in WIRE_OPTIONS}
        return {"name": self.name, **{k: v.value if isinstance(v, Enum) else v for k, v in every.items()}}

    @staticmethod
    def from_dict(d: dict | None) -> "Mode":
        """The mode a `to_dict()` describes (None or {}: plain tp)."""
        d = d or {"name": "tp"}
        kind = Mode.kind(d["name"])
        return kind(**{k: v for k, v in d.items() if k in kind.options()})


def expected_collectives(mode: Mode, cfg: ModelConfig, tp: int) -> dict[Op, int]:
    """{op: count} of one forward (logits included) in `mode` at TP=tp: the formulas of the
    tpsim.modes docstring."""
    return {} if tp == 1 else mode.collectives(cfg, tp)
