"""What reaches the draft under pipeline parallelism: every stage captures the positions in its
own layer range; the draft runs on the last stage, so what it gets depends on whether the
earlier stages hand their captures on.

- `LAST_STAGE_ONLY`: a stage other than the last returns early with (hidden, residual) only
  (SGLang's `if not self.pp_group.is_last_rank: return PPProxyTensors(...)`, vLLM's
  `IntermediateTensors` before its PP aux handoff): the earlier stages' captures are lost and
  the draft gets only the last stage's slots, a narrower capture.
- `HANDOFF`: each earlier stage sends its captures to its peer on the last stage (real
  send/recv), which concatenates every slot in capture order (vLLM PR #50514).
- `STAGE_LOCAL`: dropped as LAST_STAGE_ONLY, and every stage numbers its layers from 0, so the
  last stage captures other boundaries (`numbered_on`; vLLM's llama.py up to 0.29.0).
- `REFUSED`: the engine refuses the launch at start-up (SGLang's server-args check, vLLM's model
  check from 0.30.0); nothing runs, the profile carries the engine's error text.
"""

from __future__ import annotations

from enum import Enum

import torch

from tpsim.capture.positions import Position, PositionKind
from tpsim.capture.recorder import Recorder
from tpsim.parallel.group import TPGroup
from tpsim.parallel.pipeline import Stage


class Handoff(Enum):
    """What a PP stage other than the last does with the aux hidden states it captured."""

    LAST_STAGE_ONLY = "dropped: a stage other than the last returns early with hidden and residual only"
    HANDOFF = "sent to the last stage, which concatenates them in capture order"
    REFUSED = "refused at start-up: the engine raises before it serves"
    STAGE_LOCAL = ("dropped, and each stage numbers its layers from 0: on the last stage an id meant for boundary b "
                   "captures boundary start + b")

    @property
    def option(self) -> str:
        """Its --pp-capture name."""
        return {Handoff.LAST_STAGE_ONLY: "last-stage", Handoff.HANDOFF: "handoff"}.get(self, self.name.lower())


PP_CAPTURES = {h.option: h for h in (Handoff.LAST_STAGE_ONLY, Handoff.HANDOFF)}  # what --pp-capture may choose


def numbered_on(p: Position, last: Stage) -> Position | None:
    """What the last stage captures for `p` when it numbers its layers from 0 (STAGE_LOCAL): boundary b tested as
    start + b (None: past the stage's end, never matched)."""
    if p.kind is PositionKind.FINAL:
        return p
    b = p.boundary + last.start
    return Position.at_boundary(b) if b <= last.end else None


def stage_of(p: Position, stages: list[Stage]) -> Stage:
    """The stage whose forward sees position p (`final` and the last layer's output: the last)."""
    b = stages[-1].end if p.kind is PositionKind.FINAL else p.boundary
    return next(s for s in stages if s.holds_boundary(b))


def aux_sends(positions: list[Position], stages: list[Stage], stage: Stage, handoff: Handoff) -> int:
    """How many captured slots `stage` sends to the last stage (HANDOFF, a stage other than the last)."""
    if handoff is not Handoff.HANDOFF or stage.last:
        return 0
    return sum(stage_of(p, stages) == stage for p in positions)


def collect(recorder: Recorder, group: TPGroup, stage: Stage, stages: list[Stage], handoff: Handoff,
            shape: tuple[int, int], dtype: torch.dtype) -> list[tuple[Position, torch.Tensor]] | None:
    """After a forward: on the last stage, the (position, tensor) slots that reach the draft, in
    capture order; elsewhere None, after sending this stage's slots on under HANDOFF. `shape`,
    `dtype`: one slot's (`[T, hidden]` of the model's dtype in pure TP)."""
    positions = recorder.positions
    if not stage.last:
        if handoff is Handoff.HANDOFF:
            last = stage.peer(group.rank, stages[-1].index)
            for p in positions:
                if stage_of(p, stages) == stage:
                    group.send(recorder.store[p], last, f"pipeline.aux.{p}")
        return None
    got = dict(recorder.store)
    if handoff is Handoff.HANDOFF:
        for s in stages[:-1]:
            for p in positions:
                if stage_of(p, stages) == s:
                    got[p] = group.recv(shape, dtype, s.peer(group.rank, s.index), f"pipeline.aux.{p}")
    return [(p, got[p]) for p in positions if p in got]
