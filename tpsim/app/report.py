"""`tpsim check`'s verdict: the ranks' results per TP degree against the run's expectations."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tpsim import __version__
from tpsim.profiles.resolution import Resolution
from tpsim.capture.pipeline import stage_of
from tpsim.modes import expected_collectives
from tpsim.parallel.placement import S0
from tpsim.run.graphs import GraphCheck
from tpsim.run.graphs import failures as graph_failures
from tpsim.run.jobs import NEAR_TIE
from tpsim.run.pipeline import stage_collectives
from tpsim.run.results import RankCheck, SlotVerdict
from tpsim.run.spec import RunSpec

TOLERANCE_METRIC = "||TP=t - TP=1||_F / ||TP=1||_F"


@dataclass
class CheckRow:
    """One TP degree: what its ranks captured, how it compares, and why it fails (if it does)."""

    tp: int
    ranks: int
    routing_note: str | None
    shapes: str
    expected_shape: list
    identical: bool | None
    rel_err: float | None
    logits_rel_err: float | None
    all_reduces: int | list[int]
    expected_all_reduces: int
    collectives: dict[str, int]
    expected_collectives: dict[str, int]
    all_reduce_bytes: int
    verdicts: list[SlotVerdict] | None
    ok: bool
    failures: list[str]
    stage_collectives: list[dict] | None = None  # PP: per stage, its layers, ranks, traced and expected collectives


@dataclass(frozen=True)
class GraphRow:
    """`--cuda-graph` at one degree: what the graphed and the eager batch captured, and what is wrong."""

    check: GraphCheck
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def graph_rows(spec: RunSpec, checks: list[GraphCheck]) -> list[GraphRow]:
    return [GraphRow(c, graph_failures(c, spec.graphs.ids, spec.tolerance))
            for c in sorted(checks, key=lambda c: c.tp)]


@dataclass
class CheckReport:
    spec: RunSpec
    resolution: Resolution
    rows: list[CheckRow]
    notes: list[str] = field(default_factory=list)
    graphs: list[GraphRow] = field(default_factory=list)  # --cuda-graph: the graphed batch per degree

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) and not self.resolution.findings and all(g.ok for g in self.graphs)

    @property
    def tolerance(self) -> float:
        return self.spec.tolerance

    def to_dict(self) -> dict:
        """`tpsim check --json` (fields are added, never renamed)."""
        s = self.spec
        return {"model": s.cfg.to_dict(), "convention": self.resolution.to_dict(), "dtype": s.dtype,
                "pipeline": s.pipeline and s.pipeline.to_dict(),
                "tokens": len(s.tokens), "mode": s.mode.to_dict(), "tolerance": self.tolerance,
                "tolerance_metric": TOLERANCE_METRIC, "rows": [asdict(r) for r in self.rows], "ok": self.ok,
                "tpsim_version": __version__, "capture_strategy": s.strategy.value, "weights": s.source.weights,
                "checkpoint_fingerprint": s.source.fingerprint, "notes": list(s.source.notes),
                "cuda_graph": s.graphs and {**s.graphs.to_dict(), "rows": [asdict(g) for g in self.graphs]}}


def model_collectives(collectives) -> dict[str, int]:
    """{op: count} of the model's collectives (check's own comparisons and capture gathers left out)."""
    counts: dict[str, int] = {}
    for op, caller, _ in collectives:
        if not caller.startswith(("check.", "capture.")):
            counts[op] = counts.get(op, 0) + 1
    return counts


OP_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC"}


def ops_text(counts: dict[str, int]) -> str:
    return " ".join(f"{OP_SHORT.get(op, op)} {n}" for op, n in sorted(counts.items())) or "none"


def tbo_reason(spec: RunSpec, missing: list[str]) -> str:
    """Why the engine's capture under two-batch overlap is narrower, and the fix."""
    f, n = spec.cfg.first_k_dense_replace, len(spec.positions)
    return (f"two-batch overlap: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} in the TBO region "
            f"(layers >= first_k_dense_replace = {f}), which runs outside the capture loop: {n - len(missing)} of "
            f"{n} slots captured, the capture narrower than the draft's fc expects (sglang deepseek_v2.py "
            "DeepseekV2Model.forward: normal_end_layer = first_k_dense_replace, the rest in model_forward_maybe_tbo); "
            "fix: capture each micro-batch and concatenate their rows in token order (sglang PR #32680, closed "
            "unmerged; --strategy micro-batches)")


def summarize(spec: RunSpec, res: Resolution, tps: list[int], results: list[RankCheck]) -> CheckReport:
    row = _row if spec.pipeline is None else pp_row
    return CheckReport(spec, res, [row(spec, tp, [r for r in results if r.tp == tp]) for tp in tps])


def _row(spec: RunSpec, tp: int, mine: list[RankCheck]) -> CheckRow:
    mode, cfg, tol = spec.mode, spec.cfg, spec.tolerance
    T, width = len(spec.tokens), len(spec.positions) * cfg.hidden_size
    shapes = sorted({json.dumps(r.shape) for r in mine})
    errs = [r.rel_err for r in mine if r.rel_err is not None]
    logit_errs = [r.logits_rel_err for r in mine if r.logits_rel_err is not None]
    expected = expected_collectives(mode, cfg, tp)
    traced = [model_collectives(r.collectives) for r in mine]
    failures = []
    own_tokens = mode.rank_local and tp > 1
    if own_tokens:  # each rank its own contiguous share of the tokens
        sizes = mode.token_split(T, tp)
        want = {r.rank: [n, width] for r, n in zip(sorted(mine, key=lambda r: r.group_rank), sizes)}
        if any(r.shape != want[r.rank] for r in mine):
            failures.append(f"capture shapes {[r.shape for r in mine]} are not each rank's own tokens x {width}")
        expected_shape = [f"[{n}, {width}]" for n in sizes]
    else:
        expected_shape = [T, width]
        missing = next((r.missing for r in mine if r.missing), [])
        if missing:
            failures.append(tbo_reason(spec, missing))
        mixed = next((r.shape[0] for r in mine if isinstance(r.shape[0], list)), None)
        if mixed is not None:  # a local capture of scattered positions next to gathered or replicated ones
            rows = ", ".join(f"{p} {n}" for p, n in zip(spec.positions, mixed))
            failures.append(f"mixed shapes: the captured positions hold different token counts on a rank ({rows} "
                            f"rows of {T}): the engine's torch.cat of the aux hidden states fails")
        elif shapes != [json.dumps(expected_shape)]:
            failures.append(f"capture shapes {', '.join(shapes)} != {expected_shape}")
    if any(r.identical is False for r in mine):
        bad = sorted(r.rank for r in mine if r.identical is False and r.group_rank != 0)
        failures.append(f"ranks {bad} differ from their group's rank 0")
    fix = mode.scattered_fix()
    for v in (v for r in mine for v in (r.verdicts or []) if not v.correct):
        failures.append(f"{v.position}: {v.placement}: {v.reason}" + (f"; {fix}" if fix and v.placement == S0 else ""))
    aliased = next((r.modified for r in mine if r.modified), [])
    for slot, now in aliased:
        holds = f"it now holds {now}, not {slot}" if now else f"it no longer holds {slot}"
        failures.append(f"{slot}: modified after capture (aliasing): the capture kept a reference to the residual "
                        f"and the fused in-place add-RMSNorms after it wrote into it: {holds}; clone the residual "
                        "when capturing (SGLang communicator.py clones it; sglang PR #39286 fixes the same in Gemma)")
    finite = all(r.finite for r in mine)
    if not finite:
        first = next((r for r in mine if not r.finite and r.first_nonfinite), None)
        where = "" if first is None else (f"; the first NaN/Inf appeared at {first.first_nonfinite[0]} "
                                          f"(token {first.first_nonfinite[1]}) on rank {first.rank}")
        failures.append(f"the capture holds NaN or Inf{where}")
    rel = max(errs) if errs else None
    if rel is not None and not rel <= tol and finite:
        failures.append(f"relative error {rel:.3e} against TP=1 exceeds {tol:.0e}")
    lrel = max(logit_errs) if logit_errs else None
    if lrel is not None and not lrel <= tol:
        failures.append(f"logits relative error {lrel:.3e} against TP=1 exceeds {tol:.0e}")
    shortfall = mode.gather_shortfall(T, tp)
    if shortfall and ((rel is not None and not rel <= tol) or (lrel is not None and not lrel <= tol)):
        failures.append(shortfall)
    if any(t != expected for t in traced):
        got = next(t for t in traced if t != expected)
        failures.append(f"collectives per forward {ops_text(got)}, expected {ops_text(expected)} "
                        f"({mode.name} at TP={tp}; tpsim.modes.expected_collectives)")
    real = next((r.real_flip for r in mine if r.real_flip is not None), None)
    if real is not None:
        k, t, margin = real
        failures.append(f"token {t} picked other experts than at TP=1 in MoE layer {k} across a router margin of "
                        f"{margin:.2e}, above the near-tie bound {NEAR_TIE[spec.dtype]:.0e} of {spec.dtype}: a real "
                        "difference, not rounding")
    counts = sorted({r.all_reduces for r in mine})
    flips = [r.routing_flip for r in mine if r.routing_flip is not None]
    compared = min((r.compared for r in mine if r.compared is not None), default=1.0)
    note = (f"from token {min(flips)} on, some tokens picked other experts than at TP=1 (a routing near-tie "
            f"that {spec.dtype} rounding tipped); the entries it reaches are left out, {compared:.0%} of the "
            "capture is compared") if flips else None
    return CheckRow(
        tp=tp, ranks=len(mine), routing_note=note,
        shapes=" ".join(f"{s} x{sum(json.dumps(r.shape) == s for r in mine)}" for s in shapes),
        expected_shape=expected_shape, identical=None if own_tokens else all(r.identical for r in mine),
        rel_err=rel, logits_rel_err=lrel, all_reduces=counts[0] if len(counts) == 1 else counts,
        expected_all_reduces=expected.get("all_reduce", 0), collectives=traced[0] if traced else {},
        expected_collectives=expected, all_reduce_bytes=mine[0].all_reduce_bytes if mine else 0,
        verdicts=next((r.verdicts for r in mine if r.verdicts), None), ok=not failures, failures=failures)


def pp_row(spec: RunSpec, tp: int, mine: list[RankCheck]) -> CheckRow:
    """One TP degree under pipeline parallelism: every stage's collectives against its formula, and
    on the last stage (where the draft runs) the slots that reached it, compared with TP=1, PP=1."""
    cfg, pipe, pos, tol = spec.cfg, spec.pipeline, list(spec.positions), spec.tolerance
    every = pipe.stages(cfg.num_hidden_layers, tp)
    T, H = len(spec.tokens), cfg.hidden_size
    expected_shape = [T, len(pos) * H]
    last = sorted((r for r in mine if r.stage == every[-1].index), key=lambda r: r.group_rank)
    failures, per_stage = [], []
    got = list(last[0].slots) if last else []
    lost = []
    for p in pos:
        if str(p) in got:
            got.remove(str(p))
        else:
            lost.append(p)
    for p in lost:
        s = stage_of(p, every)
        failures.append(f"pipeline parallel: {p} is captured on stage {s.index} (layers {s.start}..{s.end - 1}, ranks "
                        f"{s.ranks[0]}..{s.ranks[-1]}), which returns "
                        f"early (not the last PP rank): the slot never reaches the draft; the capture is "
                        f"{len(pos) - len(lost)} x {H}, the draft's fc expects {len(pos)} x {H}"
                        f"{f' ({pipe.why})' if pipe.why else ''}; fix: hand the aux hidden states to the last stage "
                        f"(vLLM PR #50514; --pp-capture handoff), or capture only positions on {every[-1]}")
    shapes = sorted({json.dumps(r.shape) for r in last})
    if not lost and shapes != [json.dumps(expected_shape)]:
        failures.append(f"capture shapes {', '.join(shapes)} != {expected_shape}")
    if any(r.identical is False for r in last):
        failures.append(f"ranks {sorted(r.rank for r in last if r.identical is False and r.group_rank)} differ from "
                        "their group's rank 0")
    for v in (v for r in last for v in (r.verdicts or []) if not v.correct):
        failures.append(f"{v.position}: {v.placement}: {v.reason}")
    if not all(r.finite for r in last):
        failures.append("the capture holds NaN or Inf")
    errs = [r.rel_err for r in last if r.rel_err is not None]
    rel = max(errs) if errs else None
    if rel is not None and not rel <= tol:
        failures.append(f"relative error {rel:.3e} against TP=1, PP=1 exceeds {tol:.0e}")
    lerrs = [r.logits_rel_err for r in last if r.logits_rel_err is not None]
    lrel = max(lerrs) if lerrs else None
    if lrel is not None and not lrel <= tol:
        failures.append(f"logits relative error {lrel:.3e} against TP=1, PP=1 exceeds {tol:.0e}")
    for st in every:
        ranks = [r for r in mine if r.stage == st.index]
        want = stage_collectives(cfg, tp, st, every, pos, pipe.handoff)
        traced = [model_collectives(r.collectives) for r in ranks]
        per_stage.append({"stage": st.index, "layers": [st.start, st.end - 1], "ranks": list(st.ranks),
                          "collectives": traced[0] if traced else {}, "expected": want})
        bad = next((t for t in traced if t != want), None)
        if bad is not None or len(ranks) != tp:
            failures.append(f"{st}: collectives per forward {ops_text(bad or {})}, expected {ops_text(want)} "
                            f"(pipeline parallel PP={pipe.size} x TP={tp}; tpsim.run.pipeline.stage_collectives)"
                            if bad is not None else f"{st}: {len(ranks)} ranks reported, expected {tp}")
    head = last[0] if last else None
    return CheckRow(
        tp=tp, ranks=len(mine), routing_note=None,
        shapes=" ".join(f"{s} x{sum(json.dumps(r.shape) == s for r in last)}" for s in shapes),
        expected_shape=expected_shape, identical=all(r.identical is not False for r in last), rel_err=rel,
        logits_rel_err=lrel, all_reduces=head.all_reduces if head else 0,
        expected_all_reduces=per_stage[-1]["expected"].get("all_reduce", 0),
        collectives=per_stage[-1]["collectives"], expected_collectives=per_stage[-1]["expected"],
        all_reduce_bytes=head.all_reduce_bytes if head else 0,
        verdicts=next((r.verdicts for r in last if r.verdicts), None), ok=not failures, failures=failures,
        stage_collectives=per_stage)
