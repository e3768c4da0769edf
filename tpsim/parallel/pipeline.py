"""Pipeline parallelism (PP): which decoder layers each stage holds, and which ranks a stage is.

A PP x TP world has pp * tp ranks; stage s is the contiguous block of ranks s*tp .. s*tp+tp-1,
so the TP group of that block (tpsim.parallel.launch.build_groups) is the stage's group. Group
rank r of stage s hands its activations to group rank r of stage s+1 (every rank of a stage
holds the same replicated stream in pure TP, so each sends its own copy).

The layer split is the engine's `get_pp_indices(num_hidden_layers, pp_rank, pp_size)`; the two
engines give the remainder layers to different stages:

- SGLang, python/sglang/srt/distributed/utils.py (sgl-project/sglang @1107be11): the last
  `L % pp` stages get one extra layer (`if pp_rank >= pp_size - remainder`).
- vLLM, vllm/distributed/utils.py (vllm-project/vllm @5a6541db): `partitions[-i] += 1` for
  i in 2 .. remainder+1: the extra layers go to the stages before the last, counting back from
  the second-to-last (never to the last stage, which also runs the final norm).

Both read an environment override (`SGLANG_PP_LAYER_PARTITION`, `VLLM_PP_LAYER_PARTITION`) with
explicit per-stage counts; that override is not replayed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.base.errors import UsageError


class Split(Enum):
    """Whose `get_pp_indices` splits the layers."""

    SGLANG = "sglang"
    VLLM = "vllm"

    def counts(self, num_layers: int, pp: int) -> list[int]:
        """Layers per stage, stage 0 first."""
        base, extra = divmod(num_layers, pp)
        counts = [base] * pp
        if self is Split.SGLANG:
            for s in range(pp - extra, pp):
                counts[s] += 1
        else:
            for i in range(2, extra + 2):
                counts[-i] += 1
        return counts

    @property
    def rule(self) -> str:
        return ("the last L % pp stages get one more layer" if self is Split.SGLANG
                else "the stages before the last, from the second-to-last back, get one more layer")


SPLITS = tuple(s.value for s in Split)


def check_pp(pp: int, num_layers: int) -> None:
    """Refuse a PP degree the engines refuse (a stage without layers)."""
    if pp < 1:
        raise UsageError(f"--pp {pp} must be at least 1 (1: no pipeline parallelism)")
    if pp > num_layers:
        raise UsageError(f"--pp {pp} is more stages than the model's {num_layers} layers (every stage needs a "
                         f"layer); use --pp {num_layers} or fewer")


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`: decoder layers `start .. end-1`, on ranks `index*tp .. index*tp+tp-1`."""

    index: int
    count: int
    start: int
    end: int
    tp: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    @property
    def ranks(self) -> range:
        return range(self.index * self.tp, (self.index + 1) * self.tp)

    def peer(self, group_rank: int, stage: int) -> int:
        """The global rank of group rank `group_rank` of stage `stage` (this rank's peer there)."""
        return stage * self.tp + group_rank

    def holds_boundary(self, b: int) -> bool:
        """Whether the stream entering layer b (b = L: after the last layer) is seen on this stage."""
        return self.start <= b < self.end or (self.last and b == self.end)

    def __str__(self) -> str:
        layers = f"layer {self.start}" if self.end - self.start == 1 else f"layers {self.start}..{self.end - 1}"
        return f"stage {self.index} ({layers})"


def stages(num_layers: int, pp: int, tp: int, split: Split) -> list[Stage]:
    """Every stage of a pp x tp world, stage 0 first."""
    check_pp(pp, num_layers)
    out, start = [], 0
    for s, n in enumerate(split.counts(num_layers, pp)):
        out.append(Stage(s, pp, start, start + n, tp))
        start += n
    return out


def stage_of_rank(rank: int, num_layers: int, pp: int, tp: int, split: Split) -> Stage:
    return stages(num_layers, pp, tp, split)[rank // tp]
