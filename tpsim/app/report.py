"""`tpsim check`'s verdict: the ranks' results per TP degree against the run's expectations."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

from tpsim import __version__
from tpsim.profiles.history import Held
from tpsim.profiles.prefix import NOT_REPLAYED
from tpsim.profiles.resolution import Resolution
from tpsim.capture.pipeline import stage_of
from tpsim.modes import expected_collectives
from tpsim.parallel.ops import Op
from tpsim.parallel.placement import S0
from tpsim.profiles.profile import GraphIds
from tpsim.run.graphs import GraphCheck
from tpsim.run.jobs import NEAR_TIE
from tpsim.run.pipeline import stage_collectives
from tpsim.run.results import RankCheck, SlotVerdict
from tpsim.run.spec import RunSpec

TOLERANCE_METRIC = "||TP=t - TP=1||_F / ||TP=1||_F"


class Fails(Enum):
    """What a failed check row found."""

    SHAPES = "the capture's shape"
    TBO_NARROWER = "two-batch overlap narrows the capture"
    PREFIX = "a prefix-cache hit reuses a draft KV computed with another request's next token"
    RANKS_DIFFER = "ranks differ"
    PLACEMENT = "a slot holds a piece, not the whole tensor"
    ALIASING = "a slot was modified after capture"
    NONFINITE = "NaN or Inf"
    ERROR = "relative error against TP=1"
    LOGITS_ERROR = "logits relative error against TP=1"
    SHORTFALL = "the gather left rows out"
    COLLECTIVES = "collectives against the formula"
    REAL_FLIP = "a routing flip across a wide margin"
    UNREACHED = "a slot never reaches the draft (pipeline parallel)"
    STAGE = "a pipeline stage's collectives or ranks"
    GRAPHS_CAPTURE_NOTHING = "CUDA-graphed batches capture nothing"
    GRAPHS_CAPTURE_DEFAULTS = "CUDA-graphed batches capture the engine's default ids"


@dataclass(frozen=True)
class Failure:
    """Why a check row fails: what (`kind`), the line `text`, and the slot it is about (None: the row)."""

    kind: Fails
    text: str
    where: str | None = None

    def __str__(self) -> str:
        return self.text if self.where is None else f"{self.where}: {self.text}"


@dataclass
class StageRow:
    """Pipeline parallel: one stage at one degree, its layers, ranks, traced and expected collectives."""

    stage: int
    layers: list[int]  # first, last
    ranks: list[int]
    collectives: dict[Op, int]
    expected: dict[Op, int]


class Verdict:
    """A row of `check`'s verdict: its typed `findings`, printed and written as their lines (`failures`)."""

    findings: list[Failure]

    @property
    def failures(self) -> list[str]:
        return [str(f) for f in self.findings]

    @property
    def ok(self) -> bool:
        return not self.findings


@dataclass
class CheckRow(Verdict):
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
    collectives: dict[Op, int]
    expected_collectives: dict[Op, int]
    all_reduce_bytes: int
    verdicts: list[SlotVerdict] | None
    findings: list[Failure]
    stage_collectives: list[StageRow] | None = None  # PP: per stage

    def to_dict(self) -> dict:
        """`tpsim check --json`'s row: `ok`, then the findings as their lines under `failures`."""
        out = {}
        for k, v in asdict(self).items():
            if k == "findings":
                out.update(ok=self.ok, failures=self.failures)
            else:
                out[k] = v
        return out


@dataclass(frozen=True)
class GraphRow(Verdict):
    """`--cuda-graph` at one degree: what the graphed and the eager batch captured, and what is wrong."""

    check: GraphCheck
    findings: list[Failure]

    def to_dict(self) -> dict:
        return {"check": asdict(self.check), "failures": self.failures}


def graph_findings(c: GraphCheck, order: GraphIds, tol: float) -> list[Failure]:
    """What is wrong with one degree's graphed batch under start-up `order` (empty: nothing)."""
    batch = f"CUDA graph: the graphed batch of {c.graphed_tokens} tokens"
    eager = f"the eager batch of {c.eager_tokens} tokens captures {', '.join(c.eager) or 'nothing'}"
    src = "sglang PR #22836"
    if c.graphed == c.configured:
        out = []
        if not c.identical:
            out.append(Failure(Fails.RANKS_DIFFER, f"{batch}: ranks differ from their group's rank 0"))
        if c.rel_err is not None and not c.rel_err <= tol:
            out.append(Failure(Fails.ERROR, f"{batch}: relative error {c.rel_err:.3e} against TP=1 exceeds {tol:.0e}"))
        return out
    if order is GraphIds.NONE:
        return [Failure(Fails.GRAPHS_CAPTURE_NOTHING,
                        f"{batch} captured nothing (0 of {len(c.configured)} slots): the graphs were captured before "
                        f"the capture set was set, so graphed batches run without capture, while {eager} ({src}: zero "
                        "acceptance); set the capture set before capturing the graphs")]
    return [Failure(Fails.GRAPHS_CAPTURE_DEFAULTS,
                    f"{batch} captured {', '.join(c.graphed) or 'nothing'}, the default ids' positions, where {eager}, "
                    f"the configured ones: mixed within one server ({src}: the graph runner's workaround set the "
                    "capture set with no ids before capturing); set the configured ids before capturing the graphs")]


def graph_rows(spec: RunSpec, checks: list[GraphCheck]) -> list[GraphRow]:
    return [GraphRow(c, graph_findings(c, spec.graphs.ids, spec.tolerance))
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
                "tolerance_metric": TOLERANCE_METRIC, "rows": [r.to_dict() for r in self.rows], "ok": self.ok,
                "tpsim_version": __version__, "capture_strategy": s.strategy.value, "weights": s.source.weights,
                "prefix_cached": s.prefix_hit and {"shared": s.prefix_hit.shared, "reused": s.prefix_hit.reused,
                                                   "keys": s.prefix_hit.keys.name.lower(),
                                                   "stale_draft_kv": s.prefix_hit.stale},
                "checkpoint_fingerprint": s.source.fingerprint, "notes": list(s.source.notes),
                "cuda_graph": s.graphs and {**s.graphs.to_dict(), "rows": [g.to_dict() for g in self.graphs]}}


def model_collectives(collectives) -> dict[Op, int]:
    """{op: count} of the model's collectives (check's own comparisons and capture gathers left out)."""
    counts: dict[Op, int] = {}
    for op, caller, _ in collectives:
        if not caller.startswith(("check.", "capture.")):
            counts[op] = counts.get(op, 0) + 1
    return counts


def ops_text(counts: dict[Op, int]) -> str:
    return " ".join(f"{Op(op).short} {n}" for op, n in sorted(counts.items())) or "none"


def tbo_reason(spec: RunSpec, missing: list[str]) -> str:
    """Why the engine's capture under two-batch overlap is narrower, and the fix."""
    f, n = spec.cfg.first_k_dense_replace, len(spec.positions)
    return (f"two-batch overlap: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} in the TBO region "
            f"(layers >= first_k_dense_replace = {f}), which runs outside the capture loop: {n - len(missing)} of "
            f"{n} slots captured, the capture narrower than the draft's fc expects (sglang deepseek_v2.py "
            "DeepseekV2Model.forward: normal_end_layer = first_k_dense_replace, the rest in model_forward_maybe_tbo); "
            "fix: capture each micro-batch and concatenate their rows in token order (sglang PR #32680, closed "
            "unmerged; --strategy micro-batches)")


def prefix_note(spec: RunSpec) -> str:
    """What --prefix-cached replays, in one line."""
    hit, T = spec.prefix_hit, len(spec.tokens)
    n, k = hit.shared, hit.reused
    run = (f"a forward of tokens 0..{k - 1} fills every layer's KV first, then the prefill runs tokens {k}..{T - 1} "
           "at their positions, attending to it, and captures those rows") if k else "the prefill runs every token"
    return (f"prefix cache ({hit.held.server}, {hit.held.versions.text()}: {hit.keys.value}): the prompt shares its "
            f"first {n} tokens with a request the radix cache holds and diverges at token {n}; {k} positions are "
            f"reused: {run} ({hit.held.cited.source}); {NOT_REPLAYED}")


def prefix_reason(spec: RunSpec) -> str:
    """Why a prefix-cache hit that reuses the last shared position feeds the draft a stale KV there, and the fix
    (a later version, checked: the same hit there reuses nothing stale)."""
    hit = spec.prefix_hit
    n, later = hit.shared, hit.fixed_in()
    fix = (f"serve with sglang {Held.upgrade(later)}: the same hit reuses {later.changes['radix'].value.reused(n)} "
           f"positions and re-runs position {n - 1} with this request's token {n}; or --disable-radix-cache"
           if later else "--disable-radix-cache")
    return (f"prefix cache: {hit.held.server} keys the radix tree by tokens, so the hit reuses all {n} shared "
            f"positions, the draft's KV at position {n - 1} with them: the draft's step 0 there read [token {n} of "
            f"the request that cached the prefix, the capture at {n - 1}], and this request's token {n} is another, "
            f"so every later draft step attends to a key and value this request never had (the target's rows are "
            f"right: the capture's rows {n}..{len(spec.tokens) - 1} are the full prompt's; sglang PR #10846 measured "
            f"acceptance length 2.26 with the radix cache against 2.39 without); fix: {fix}")


def prefix_rows(report: "CheckReport") -> str | None:
    """With --prefix-cached, where the rows the capture holds are right (the suffix's, against the
    reference's same rows): which degrees, bitwise or within the tolerance (None: some row is wrong)."""
    spec = report.spec
    if not spec.prefix_cached or any(f.kind is not Fails.PREFIX for r in report.rows for f in r.findings):
        return None
    k, T = spec.prefix_cached, len(spec.tokens)
    each = [f"TP {r.tp}: bitwise" if r.rel_err == 0 and r.logits_rel_err == 0 else
            f"TP {r.tp}: rel err {r.rel_err:.2e}, logits {r.logits_rel_err:.2e}" for r in report.rows]
    return (f"the capture after the cache hit holds tokens {k}..{T - 1}, equal to the TP=1 full-prompt reference's "
            f"rows {k}..{T - 1}, logits too ({'; '.join(each)}; tolerance {report.tolerance:.0e})")


def summarize(spec: RunSpec, res: Resolution, tps: list[int], results: list[RankCheck]) -> CheckReport:
    row = _row if spec.pipeline is None else pp_row
    return CheckReport(spec, res, [row(spec, tp, [r for r in results if r.tp == tp]) for tp in tps])


def _row(spec: RunSpec, tp: int, mine: list[RankCheck]) -> CheckRow:
    mode, tol = spec.mode, spec.tolerance
    expected = expected_collectives(mode, spec.cfg, tp)
    traced = [model_collectives(r.collectives) for r in mine]
    own_tokens = mode.runs_own_tokens(tp)
    expected_shape, failures = _shape_failures(spec, tp, mine)
    failures += _rank_failures(mine, mode.scattered_fix())
    finite = all(r.finite for r in mine)
    if not finite:
        first = next((r for r in mine if not r.finite and r.first_nonfinite), None)
        where = "" if first is None else (f"; the first NaN/Inf appeared at {first.first_nonfinite[0]} "
                                          f"(token {first.first_nonfinite[1]}) on rank {first.rank}")
        failures.append(Failure(Fails.NONFINITE, f"the capture holds NaN or Inf{where}"))
    rel, lrel = _worst(r.rel_err for r in mine), _worst(r.logits_rel_err for r in mine)
    failures += _error_failures(rel if finite else None, lrel, tol, "TP=1")
    shortfall = mode.gather_shortfall(len(spec.tokens), tp)
    if shortfall and ((rel is not None and not rel <= tol) or (lrel is not None and not lrel <= tol)):
        failures.append(Failure(Fails.SHORTFALL, shortfall))
    if any(t != expected for t in traced):
        got = next(t for t in traced if t != expected)
        failures.append(Failure(Fails.COLLECTIVES, f"collectives per forward {ops_text(got)}, expected "
                                f"{ops_text(expected)} ({mode.name} at TP={tp}; tpsim.modes.expected_collectives)"))
    failures += _real_flip(spec, mine)
    counts = sorted({r.all_reduces for r in mine})
    shapes = sorted({json.dumps(r.shape) for r in mine})
    return CheckRow(
        tp=tp, ranks=len(mine), routing_note=_routing_note(spec, mine),
        shapes=" ".join(f"{s} x{sum(json.dumps(r.shape) == s for r in mine)}" for s in shapes),
        expected_shape=expected_shape, identical=None if own_tokens else all(r.identical for r in mine),
        rel_err=rel, logits_rel_err=lrel, all_reduces=counts[0] if len(counts) == 1 else counts,
        expected_all_reduces=expected.get(Op.ALL_REDUCE, 0), collectives=traced[0] if traced else {},
        expected_collectives=expected, all_reduce_bytes=mine[0].all_reduce_bytes if mine else 0,
        verdicts=next((r.verdicts for r in mine if r.verdicts), None), findings=failures)


def _worst(errs) -> float | None:
    """The largest of the ranks' errors (None: none was measured)."""
    errs = [e for e in errs if e is not None]
    return max(errs) if errs else None


def _shape_failures(spec: RunSpec, tp: int, mine: list[RankCheck]) -> tuple[list, list[Failure]]:
    """(the shape the capture should have, why it has not): under a rank-local mode at TP > 1 each
    rank's own contiguous share of the tokens, else every token (a narrower capture or mixed token counts
    named for their cause)."""
    T, width = len(spec.tokens), len(spec.positions) * spec.cfg.hidden_size
    if spec.mode.runs_own_tokens(tp):
        sizes = spec.mode.token_split(T, tp)
        want = {r.rank: [n, width] for r, n in zip(sorted(mine, key=lambda r: r.group_rank), sizes)}
        wrong = [Failure(Fails.SHAPES, f"capture shapes {[r.shape for r in mine]} are not each rank's own tokens x "
                         f"{width}")] if any(r.shape != want[r.rank] for r in mine) else []
        return [f"[{n}, {width}]" for n in sizes], wrong
    expected_shape, failures = [spec.forward_tokens, width], []  # a cache hit: the suffix's rows, as the engine
    if spec.prefix_hit is not None and spec.prefix_hit.stale:
        failures.append(Failure(Fails.PREFIX, prefix_reason(spec)))
    missing = next((r.missing for r in mine if r.missing), [])
    if missing:
        failures.append(Failure(Fails.TBO_NARROWER, tbo_reason(spec, missing)))
    mixed = next((r.shape[0] for r in mine if isinstance(r.shape[0], list)), None)
    shapes = sorted({json.dumps(r.shape) for r in mine})
    if mixed is not None:  # a local capture of scattered positions next to gathered or replicated ones
        rows = ", ".join(f"{p} {n}" for p, n in zip(spec.positions, mixed))
        failures.append(Failure(Fails.SHAPES, f"mixed shapes: the captured positions hold different token counts "
                                f"on a rank ({rows} rows of {T}): the engine's torch.cat of the aux hidden states "
                                "fails"))
    elif shapes != [json.dumps(expected_shape)]:
        failures.append(Failure(Fails.SHAPES, f"capture shapes {', '.join(shapes)} != {expected_shape}"))
    return expected_shape, failures


def _rank_failures(mine: list[RankCheck], fix: str | None = None) -> list[Failure]:
    """Ranks that differ from their group's rank 0, the diagnosis of each slot that is wrong (with the
    mode's `fix` for a token-scattered one), and slots written into after their capture."""
    failures = []
    if any(r.identical is False for r in mine):
        bad = sorted(r.rank for r in mine if r.identical is False and r.group_rank != 0)
        failures.append(Failure(Fails.RANKS_DIFFER, f"ranks {bad} differ from their group's rank 0"))
    for v in (v for r in mine for v in (r.verdicts or []) if not v.correct):
        failures.append(Failure(Fails.PLACEMENT, f"{v.placement}: {v.reason}"
                                + (f"; {fix}" if fix and v.placement == S0 else ""), v.position))
    aliased = next((r.modified for r in mine if r.modified), [])
    for slot, now in aliased:
        holds = f"it now holds {now}, not {slot}" if now else f"it no longer holds {slot}"
        failures.append(Failure(Fails.ALIASING, "modified after capture (aliasing): the capture kept a reference to "
                                f"the residual and the fused in-place add-RMSNorms after it wrote into it: {holds}; "
                                "clone the residual when capturing (SGLang communicator.py clones it; sglang PR "
                                "#39286 fixes the same in Gemma)", slot))
    return failures


def _error_failures(rel: float | None, lrel: float | None, tol: float, against: str) -> list[Failure]:
    failures = []
    if rel is not None and not rel <= tol:
        failures.append(Failure(Fails.ERROR, f"relative error {rel:.3e} against {against} exceeds {tol:.0e}"))
    if lrel is not None and not lrel <= tol:
        failures.append(Failure(Fails.LOGITS_ERROR, f"logits relative error {lrel:.3e} against {against} exceeds "
                                f"{tol:.0e}"))
    return failures


def _real_flip(spec: RunSpec, mine: list[RankCheck]) -> list[Failure]:
    real = next((r.real_flip for r in mine if r.real_flip is not None), None)
    if real is None:
        return []
    k, t, margin = real
    return [Failure(Fails.REAL_FLIP, f"token {t} picked other experts than at TP=1 in MoE layer {k} across a router "
                    f"margin of {margin:.2e}, above the near-tie bound {NEAR_TIE[spec.dtype]:.0e} of {spec.dtype}: a "
                    "real difference, not rounding")]


def _routing_note(spec: RunSpec, mine: list[RankCheck]) -> str | None:
    flips = [r.routing_flip for r in mine if r.routing_flip is not None]
    compared = min((r.compared for r in mine if r.compared is not None), default=1.0)
    return (f"from token {min(flips)} on, some tokens picked other experts than at TP=1 (a routing near-tie "
            f"that {spec.dtype} rounding tipped); the entries it reaches are left out, {compared:.0%} of the "
            "capture is compared") if flips else None


def pp_row(spec: RunSpec, tp: int, mine: list[RankCheck]) -> CheckRow:
    """One TP degree under pipeline parallelism: every stage's collectives against its formula, and
    on the last stage (where the draft runs) the slots that reached it, compared with TP=1, PP=1."""
    cfg, pos = spec.cfg, list(spec.positions)
    every = spec.pipeline.stages(cfg.num_hidden_layers, tp)
    expected_shape = [len(spec.tokens), len(pos) * cfg.hidden_size]
    last = sorted((r for r in mine if r.stage == every[-1].index), key=lambda r: r.group_rank)
    failures = _unreached(spec, every, last)
    shapes = sorted({json.dumps(r.shape) for r in last})
    if not failures and shapes != [json.dumps(expected_shape)]:
        failures.append(Failure(Fails.SHAPES, f"capture shapes {', '.join(shapes)} != {expected_shape}"))
    failures += _rank_failures(last)
    if not all(r.finite for r in last):
        failures.append(Failure(Fails.NONFINITE, "the capture holds NaN or Inf"))
    rel, lrel = _worst(r.rel_err for r in last), _worst(r.logits_rel_err for r in last)
    failures += _error_failures(rel, lrel, spec.tolerance, "TP=1, PP=1")
    per_stage, stage_failures = _stage_rows(spec, tp, mine, every)
    failures += stage_failures
    head = last[0] if last else None
    return CheckRow(
        tp=tp, ranks=len(mine), routing_note=None,
        shapes=" ".join(f"{s} x{sum(json.dumps(r.shape) == s for r in last)}" for s in shapes),
        expected_shape=expected_shape, identical=all(r.identical is not False for r in last), rel_err=rel,
        logits_rel_err=lrel, all_reduces=head.all_reduces if head else 0,
        expected_all_reduces=per_stage[-1].expected.get(Op.ALL_REDUCE, 0),
        collectives=per_stage[-1].collectives, expected_collectives=per_stage[-1].expected,
        all_reduce_bytes=head.all_reduce_bytes if head else 0,
        verdicts=next((r.verdicts for r in last if r.verdicts), None), findings=failures,
        stage_collectives=per_stage)


def _unreached(spec: RunSpec, every: list, last: list[RankCheck]) -> list[Failure]:
    """The positions that never reach the last stage (captured on a stage that returns early)."""
    pipe, pos, H = spec.pipeline, list(spec.positions), spec.cfg.hidden_size
    got, lost = list(last[0].slots) if last else [], []
    for p in pos:
        if str(p) in got:
            got.remove(str(p))
        else:
            lost.append(p)
    return [Failure(Fails.UNREACHED, f"pipeline parallel: {p} is captured on stage {s.index} (layers {s.start}.."
                    f"{s.end - 1}, ranks {s.ranks[0]}..{s.ranks[-1]}), which returns early (not the last PP rank): "
                    f"the slot never reaches the draft; the capture is {len(pos) - len(lost)} x {H}, the draft's fc "
                    f"expects {len(pos)} x {H}{f' ({pipe.why})' if pipe.why else ''}; fix: hand the aux hidden "
                    f"states to the last stage (vLLM PR #50514; --pp-capture handoff), or capture only positions on "
                    f"{every[-1]}")
            for p, s in ((p, stage_of(p, every)) for p in lost)]


def _stage_rows(spec: RunSpec, tp: int, mine: list[RankCheck], every: list) -> tuple[list[StageRow], list[Failure]]:
    """Each stage's traced collectives against stage_collectives, and the stages whose ranks differ from it
    or did not all report."""
    rows, failures, pipe = [], [], spec.pipeline
    for st in every:
        ranks = [r for r in mine if r.stage == st.index]
        want = stage_collectives(spec.cfg, tp, st, every, list(spec.positions), pipe.handoff)
        traced = [model_collectives(r.collectives) for r in ranks]
        rows.append(StageRow(st.index, [st.start, st.end - 1], list(st.ranks), traced[0] if traced else {}, want))
        bad = next((t for t in traced if t != want), None)
        if bad is not None or len(ranks) != tp:
            failures.append(Failure(Fails.STAGE, f"{st}: collectives per forward {ops_text(bad or {})}, expected "
                                    f"{ops_text(want)} (pipeline parallel PP={pipe.size} x TP={tp}; "
                                    "tpsim.run.pipeline.stage_collectives)"
                                    if bad is not None else f"{st}: {len(ranks)} ranks reported, expected {tp}"))
    return rows, failures
