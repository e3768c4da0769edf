"""A pipeline-parallel run: its PP degree, whose layer split, what the capture does at a stage
boundary, and the collectives each stage runs (the formula `check` compares with the trace).

Per stage s of a PP x TP world, in `--mode tp` (n_s of its layers; tp > 1 for the TP collectives):
all_reduce (1 if s is the first stage) + 2 n_s; all_gather 1 on the last stage (the logits);
send 2 on every stage but the last (hidden, residual), recv 2 on every stage but the first; under
HANDOFF also one send per slot a stage other than the last captured, and as many recvs on the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.capture import Position
from tpsim.capture.pipeline import Handoff, aux_sends
from tpsim.config.loader import ModelConfig
from tpsim.parallel.pipeline import Split, Stage, stages
from tpsim.parallel.ops import Op


@dataclass(frozen=True)
class Pipeline:
    """`--pp size`: the layers split as `split`'s engine splits them, captures handled per `handoff`;
    `why`: what chose the handoff (a profile behaviour and its source, or the option)."""

    size: int
    split: Split = Split.SGLANG
    handoff: Handoff = Handoff.HANDOFF
    why: str = ""

    def stages(self, num_layers: int, tp: int) -> list[Stage]:
        return stages(num_layers, self.size, tp, self.split)

    def to_dict(self) -> dict:
        return {"pp": self.size, "split": self.split.value, "capture": self.handoff.option, "why": self.why}


def stage_collectives(cfg: ModelConfig, tp: int, stage: Stage, every: list[Stage], positions: list[Position],
                      handoff: Handoff) -> dict[Op, int]:
    """{op: count} of one forward on a rank of `stage` (the module docstring's formula)."""
    counts = {Op.ALL_REDUCE: (int(stage.first) + 2 * len(stage.layers)) if tp > 1 else 0,
              Op.ALL_GATHER: int(stage.last and tp > 1),
              Op.SEND: (0 if stage.last else 2) + aux_sends(positions, every, stage, handoff),
              Op.RECV: (0 if stage.first else 2) + (sum(aux_sends(positions, every, s, handoff) for s in every)
                                                   if stage.last else 0)}
    return {op: n for op, n in counts.items() if n}
