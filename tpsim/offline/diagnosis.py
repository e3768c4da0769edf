"""`tpsim diagnose`: what did each rank of a TP group actually capture?

Given one run's per-rank tensors of a point (`ranks[r]`: `[rows_r, w_r]`, rank order) and a
reference (candidate name -> full tensor `[T, W]`), every placement hypothesis is tried against
every candidate:

| placement       | shapes it needs                                  | full tensor it implies       |
|-----------------|--------------------------------------------------|------------------------------|
| `Replicate()`   | every rank `[T, W]`                              | each rank (diff: the worst)  |
| `Partial(sum)`  | every rank `[T, W]`, tp > 1                      | sum over ranks (float64)     |
| `Shard(dim=0)`  | every rank `[rows_r, W]`, sum of rows_r = T      | concatenation along dim 0    |
| `Shard(dim=-1)` | every rank `[T, w_r]`, sum of w_r = W (or equal  | concatenation along dim -1   |
|                 | widths padded past W, e.g. a padded vocab)       | (first W columns)            |

The best (placement, candidate) pair within the threshold is the verdict: `Replicate()` of the
asked candidate is correct; another candidate is the wrong position ("this is out(1), you asked
for out(2)"); nothing within the threshold is `unexplained` (the closest pair is reported).
At tp = 1 a lone rank can only be `Replicate()`.

Similarity is DeepGEMM's / SGLang's `calc_diff(x, y) = 1 - 2*sum(x*y) / sum(x*x + y*y)` in
float64: 0 for identical tensors, (1-c)^2/(1+c^2) for y = c*x, 1 against zeros, 2 for y = -x.
A pair matches when `calc_diff <= 1e-5` if both sides are float32/float64, `<= 1e-3` if either
side is bfloat16/float16 (why: the comment on `THRESHOLDS`).
"""


from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from tpsim.capture.positions import Position
from tpsim.base.errors import UsageError
from tpsim.offline.capture_read import read_run
from tpsim.offline.dumps import RankSet, unknown_point
from tpsim.offline.reference import Reference, read_reference, reference_num_layers
from tpsim.parallel.placement import P, R, S0, S1, Placement

UNEXPLAINED = "unexplained"
TOKEN_SUBSET = "token subset"  # one file with fewer rows than the tokens, each row one token's (in token order)
PLACEMENTS = (R, S0, S1, P, TOKEN_SUBSET)  # tie-break order

# calc_diff thresholds (calc_diff ~ rel_err^2 / 2 for rel_err = ||x - y|| / ||y||).
# float32 on both sides: TP round-off gives ~1e-13 (measured <= 9.2e-14 over 400 runs of up to 4
# layers, TP 2/4/8 vs TP 1; transformers parity rel_err <= 7.1e-7 gives 2.5e-13). 1e-5 is eight
# orders above that, still admits a float32 reference from another implementation (TF32 GEMMs:
# rel_err ~4e-3 gives ~1e-5), and stays 1000x below a wrong tensor.
# bfloat16/float16 on either side: TP round-off is ~1e-2 relative error, calc_diff ~5e-5
# (measured <= 6.9e-5; tpsim's bf16 bound rel_err 3e-2 gives 4.5e-4). 1e-3 (also SGLang
# dump_comparator's default --diff-threshold) is above both and 10x below a wrong tensor.
# A wrong tensor: another layer or a per-rank partial sum gives >= 1e-2 (tp=2 equal halves: 0.2;
# adjacent residual-stream layers of a deep model: cosine 0.99 and a few % norm growth, ~1e-2).
# the known engine path that drops tokens' states (tpsim/profiles/returned.py has the engine versions)
TRUNCATED = ("SGLang's return_hidden_states under speculative decoding keeps one row per verify step up to 0.5.13: "
             "sglang issue #26163, fixed by PR #28496 in 0.5.14")
THRESHOLDS = {"exact": 1e-5, "low_precision": 1e-3}
SIMILARITY = "calc_diff = 1 - 2*sum(x*y) / sum(x*x + y*y), float64 (0 = identical)"
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Verdict:
    point: str              # the asked tensor's name (e.g. "layers.3.attn.o_proj.partial" or "out(2)")
    placement: Placement | str  # a Placement, or UNEXPLAINED
    matches: str | None     # the reference candidate it matches (None when unexplained)
    correct: bool           # Replicate() and matches == the asked name
    diff: float             # calc_diff of the best match
    reason: str             # one line for humans


def calc_diff(x, y) -> float:
    """`1 - 2*sum(x*y) / sum(x^2 + y^2)` in float64 (DeepGEMM, SGLang): 0 = identical; 0 for two
    all-zero tensors; NaN when either holds NaN/Inf. Shapes must be equal."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes {list(x.shape)} and {list(y.shape)} differ")
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum().item()
    if denom == 0:
        return 0.0
    return 1.0 - 2.0 * (x * y).sum().item() / denom


def match_threshold(*dtypes: torch.dtype) -> float:
    """1e-3 when any side is bfloat16/float16, else 1e-5 (see THRESHOLDS)."""
    return THRESHOLDS["low_precision" if any(d in LOW_PRECISION for d in dtypes) else "exact"]


def identical(ranks: list[torch.Tensor]) -> bool:
    """Every rank bitwise equal to rank 0."""
    return all(r.shape == ranks[0].shape and r.dtype == ranks[0].dtype and torch.equal(r, ranks[0]) for r in ranks)


# --- placements ----------------------------------------------------------------------------

def _implied(ranks: list[torch.Tensor], T: int, W: int) -> list[tuple[str, list[torch.Tensor], str]]:
    """(placement, the float64 tensors that must each equal the candidate, detail) for every
    placement whose shapes fit a candidate `[T, W]`."""
    tp, shapes = len(ranks), [tuple(r.shape) for r in ranks]
    f64 = [r.double() for r in ranks]
    out = []
    if all(s == (T, W) for s in shapes):
        out.append((R, f64, ""))
        if tp > 1:
            out.append((P, [torch.stack(f64).sum(0)], ""))
    if tp > 1 and all(s[1] == W for s in shapes) and sum(s[0] for s in shapes) == T:
        out.append((S0, [torch.cat(f64, 0)], "+".join(str(s[0]) for s in shapes)))
    widths = [s[1] for s in shapes]
    if tp > 1 and all(s[0] == T for s in shapes):
        if sum(widths) == W:
            out.append((S1, [torch.cat(f64, -1)], ""))
        elif sum(widths) > W > widths[0] and len(set(widths)) == 1:  # narrower shards, padded at the end
            out.append((S1, [torch.cat(f64, -1)[:, :W]], f"padded:{sum(widths) - W}"))
    return out


def _tries(ranks, reference, residual=None):
    """(diff, placement, candidate, detail, threshold) of every fitting pair."""
    out, cache = [], {}
    for name, ref in reference.items():
        if ref.dim() != 2:
            continue
        key = tuple(ref.shape)
        if key not in cache:
            cache[key] = _implied(ranks, *key)
        thr = match_threshold(ref.dtype, *(r.dtype for r in ranks))
        for placement, fulls, detail in cache[key]:
            diff = max(calc_diff(f, ref) for f in fulls)
            out.append((diff, placement, name, detail, thr))
        rows = _token_subset(ranks, ref, thr)
        if rows is not None:
            out.append((calc_diff(ranks[0].double(), ref.double()[list(rows)]), TOKEN_SUBSET, name, rows, thr))
        res = (residual or {}).get(name)
        if res is not None and len(ranks) > 1 and all(tuple(r.shape) == key for r in ranks) \
                and tuple(res.shape) == key:
            # hidden + residual with hidden Partial(sum), residual Replicate(): the ranks sum to
            # full hidden + tp * residual, so the candidate is that sum minus (tp - 1) residuals
            full = torch.stack([r.double() for r in ranks]).sum(0) - (len(ranks) - 1) * res.double()
            out.append((calc_diff(full, ref), P, name, "plus-residual", thr))
    return out


def _token_subset(ranks, ref: torch.Tensor, thr: float) -> tuple[int, ...] | None:
    """The token indices, when one file's rows are each, in order, within `thr` of a distinct row of `ref` and
    fewer than its tokens (a capture or a return path that drops tokens), else None."""
    if len(ranks) != 1 or ranks[0].shape[1] != ref.shape[1] or not 0 < ranks[0].shape[0] < ref.shape[0]:
        return None
    x, y = ranks[0].double(), ref.double()
    diffs = 1 - 2 * (x @ y.T) / ((x * x).sum(1)[:, None] + (y * y).sum(1)[None, :])
    rows, j = [], -1
    for i, row in enumerate(diffs.tolist()):
        j = next((t for t in range(j + 1, y.shape[0] - (x.shape[0] - 1 - i)) if row[t] <= thr), None)
        if j is None:
            return None
        rows.append(j)
    return tuple(rows)


def spans(rows: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 7, 8) -> "0-2, 5, 7-8"."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            out.append(str(rows[start]) if i - 1 == start else f"{rows[start]}-{rows[i - 1]}")
            start = i
    return ", ".join(out)


def diagnose_tensors(ranks: list[torch.Tensor], reference: dict[str, torch.Tensor], asked: str,
                     residual: dict[str, torch.Tensor] | None = None) -> Verdict:
    """Infer what `ranks` (rank r's local `[rows, width]` tensor, in rank order) hold, given the
    reference candidates (name -> full `[T, W]`) and the name the user `asked` for.

    `residual` (candidate name -> the residual `[T, W]` its `hidden + residual` adds) also tries
    `Partial(sum)` of the hidden part with the residual added on every rank: what a model-level
    capture holds when the all-reduce is deferred into the next layer (ar-fusion).

    The lowest-diff pair within its threshold wins (ties: the asked name, then Replicate(),
    Shard(dim=0), Shard(dim=-1), Partial(sum)); none within: `unexplained` with the closest."""
    if not ranks:
        raise ValueError("diagnose_tensors needs at least one rank")
    if any(r.dim() != 2 for r in ranks):
        raise ValueError(f"rank tensors must be 2-D [rows, width], got {[list(r.shape) for r in ranks]}")
    tries = _tries(ranks, reference, residual)
    order = {p: i for i, p in enumerate(PLACEMENTS)}
    key = lambda t: (t[0], t[2] != asked, order[t[1]])  # noqa: E731
    good = sorted((t for t in tries if t[0] <= t[4]), key=key)
    if not good:
        return _unexplained(ranks, reference, asked, tries)
    diff, placement, name, detail, _ = good[0]
    also = sorted({t[2] for t in good[1:] if t[2] != name and not _same(reference[t[2]], reference[name])})
    return Verdict(asked, placement, name, placement == R and name == asked, diff,
                   _reason(ranks, reference, asked, placement, name, detail, diff, also))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same tensor under two names (an alias, or equal values: a TP=1 `x.partial` is `x.out`)."""
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def _unexplained(ranks, reference, asked, tries) -> Verdict:
    shapes = shapes_text([list(r.shape) for r in ranks])
    if not tries:
        full = sorted({str(list(t.shape)) for t in reference.values()})
        return Verdict(asked, UNEXPLAINED, None, False, math.inf,
                       f"no placement fits the shapes: ranks {shapes}, reference candidates {', '.join(full)}")
    diff, placement, name, _, thr = min(tries, key=lambda t: (math.isnan(t[0]), t[0]))
    bad = "" if all(torch.isfinite(r).all() for r in ranks) else "the ranks hold NaN or Inf; "
    return Verdict(asked, UNEXPLAINED, None, False, diff,
                   f"{bad}no placement explains it; closest: {placement} of {name} with diff {diff:.2e} > {thr:.0e}"
                   f"{_missing(reference, asked)}")


def _missing(reference, asked) -> str:
    return "" if asked in reference else f" (the reference has no {asked})"


def _reason(ranks, reference, asked, placement, name, detail, diff, also) -> str:
    tp = len(ranks)
    wrong = "" if name == asked else (f"; this is {name}, you asked for {asked}" if asked in reference
                                      else f" (the reference has no {asked})")
    if placement == R:
        same = ("" if tp == 1 else f" (bitwise identical on all {tp} ranks)" if identical(ranks)
                else f" (ranks not bitwise identical; largest rank diff {diff:.1e})")
        if name != asked and asked in reference:
            text = f"replicated, but this is {name}, you asked for {asked}{same}"
        else:
            text = f"{'the lone rank' if tp == 1 else 'every rank'} holds the full {name}{same}{wrong}"
    elif placement == P and detail == "plus-residual":
        text = (f"captured before a deferred all-reduce (per-rank partial sums of the layer output plus the "
                f"replicated residual): summed over {tp} ranks, less {tp - 1} residuals, they are {name}{wrong}")
    elif placement == P:
        text = f"captured before an all-reduce (per-rank partial sums): the sum over {tp} ranks is {name}{wrong}"
    elif placement == TOKEN_SUBSET:
        T = reference[name].shape[0]
        text = (f"holds {len(detail)} of {T} tokens' states, each equal to {name}'s row of one token (tokens "
                f"{spans(detail)}): {T - len(detail)} tokens have none{wrong}; a capture or return path that "
                f"drops tokens ({TRUNCATED})")
    elif placement == S0:
        text = (f"each rank holds only its share of the tokens (rows {detail}): concatenated they are "
                f"{name}{wrong}")
    else:
        pad = f", the last {detail.split(':')[1]} columns padding" if detail else ""
        text = (f"each rank holds only a slice of the hidden dim (widths {'+'.join(str(r.shape[1]) for r in ranks)}"
                f"{pad}): concatenated they are {name}{wrong}")
    if also:
        text += f"; also within the threshold: {', '.join(also)}"
    return text


def shapes_text(shapes: list[list[int]]) -> str:
    """`[12, 16] x4`, or for uneven shards `[4+4+2+2, 16]` / `[12, 8+8]`."""
    if all(s == shapes[0] for s in shapes):
        return f"{shapes[0]} x{len(shapes)}"
    if all(len(s) == 2 for s in shapes):
        if len({s[1] for s in shapes}) == 1:
            return f"[{'+'.join(str(s[0]) for s in shapes)}, {shapes[0][1]}]"
        if len({s[0] for s in shapes}) == 1:
            return f"[{shapes[0][0]}, {'+'.join(str(s[1]) for s in shapes)}]"
    return " ".join(map(str, shapes))


# --- one run's rank files against a reference ----------------------------------------------

@dataclass
class PointRow:
    """One point of a diagnosed run: the verdict and what it was reached from."""

    point: str                        # the point's name in the rank files
    placement: Placement | str        # a Placement, or UNEXPLAINED
    matches: str | None
    correct: bool
    diff: float | None                # None: nothing fitted
    reason: str
    asked: str                        # the reference candidate the point was compared with first
    ranks: int
    shapes: list[list[int]]
    dtype: str
    threshold: float
    ranks_identical: bool
    declared: str | None              # the placement the files declare (tpsim rank dumps)
    declared_agrees: bool | None


@dataclass
class DiagnoseReport:
    files: list[str]
    kind: str
    tp: int
    tokens: int | None
    reference: dict                   # path, kind, candidates
    notes: list[str]
    points: list[PointRow]

    @property
    def ok(self) -> bool:
        return all(r.correct for r in self.points)

    def to_dict(self) -> dict:
        """`tpsim diagnose --json`."""
        return {"files": self.files, "kind": self.kind, "tp": self.tp, "tokens": self.tokens,
                "reference": self.reference, "similarity": SIMILARITY,
                "thresholds": {"float32/float64 on both sides": THRESHOLDS["exact"],
                               "bfloat16/float16 on either side": THRESHOLDS["low_precision"]},
                "notes": self.notes, "points": [asdict(r) for r in self.points], "ok": self.ok}


def check_consistent(rs: RankSet, point: str) -> None:
    """One dtype on every rank, 2-D tensors, and equal shapes or equal widths (uneven token shards)."""
    ts = rs.points[point]
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in ts})
    if len(dtypes) > 1:
        raise UsageError(f"point {point}: the ranks hold different dtypes ({', '.join(dtypes)}); pass the files "
                         f"of one run")
    shapes = [list(t.shape) for t in ts]
    if any(len(s) != 2 for s in shapes) or len({s[1] for s in shapes}) > 1:
        raise UsageError(f"point {point}: the ranks' shapes {shapes} are inconsistent (a run's ranks hold equal "
                         f"shapes or, token-sharded, equal widths); pass the files of one run")


def check_tokens(rs: RankSet, ref: Reference) -> None:
    Ts = sorted({t.shape[0] for t in ref.candidates.values()})
    T = len(rs.input_ids) if rs.input_ids is not None else None
    if T is not None and Ts and Ts != [T]:
        raise UsageError(f"the reference {ref.path} has {'/'.join(map(str, Ts))} tokens and the rank files {T}; "
                         f"compare captures of the same input")
    if T is not None and ref.input_ids is not None:
        if len(ref.input_ids) != T:
            raise UsageError(f"the reference {ref.path} has {len(ref.input_ids)} input_ids and the rank files {T}; "
                             f"compare captures of the same input")
        if not torch.equal(ref.input_ids.long(), rs.input_ids.long()):
            raise UsageError(f"the reference {ref.path} holds other input_ids than the rank files; compare "
                             f"captures of the same input")


def asked_name(rs: RankSet, ref: Reference, point: str) -> str:
    """The reference candidate the point means: its own name, else its position, else, when the
    reference names no position (its slots only by index: a vLLM file, a split by --hidden-size),
    an alias of it (a vLLM slot named by --layer-ids is still `slot{i}`)."""
    by_index = not any(_is_position(n) for n in ref.candidates)
    aliases = [a for a, p in rs.aliases.items() if p == point] if by_index else []
    return next((n for n in (point, rs.position.get(point), *aliases) if n in ref.candidates),
                rs.position.get(point, point))


def _aliased(rows: list[PointRow]) -> None:
    """Name in-place aliasing where the rows show it: two or more slots holding one and the same
    state later than each asked for are what a capture that kept the residual by reference reads
    after later fused add-RMSNorms updated it in place (one later slot alone may be a wrong id)."""
    later: dict[str, list[PointRow]] = {}
    for r in rows:
        if r.matches and r.matches != r.asked and _is_position(r.matches) and _is_position(r.asked) \
                and _order(r.matches) > _order(r.asked):
            later.setdefault(r.matches, []).append(r)
    for name, same in later.items():
        if len(same) < 2:
            continue
        for r in same:
            r.reason += (f"; modified after capture (aliasing): {len(same)} slots ({', '.join(x.asked for x in same)}) "
                         f"hold the same later state, {name}, as a residual kept by reference does once later "
                         "in-place fused add-RMSNorms have written into it: clone the residual when capturing "
                         "(SGLang's communicator.py clones it; sglang PR #39286 fixed Gemma's captures)")


def _order(name: str) -> float:
    return Position.parse(name, 1 << 62).sort_key()


def _is_position(name: str) -> bool:
    try:
        Position.parse(name, 1 << 62)
    except UsageError:
        return False
    return True


def diagnose_files(files: list[str], reference: str, points: list[str] | None = None,
                   positions: list[str] | None = None, hidden: int | None = None,
                   step: int | None = None, layer_ids: list[int] | None = None,
                   num_layers: int | None = None, convention: str = "vllm-ids") -> DiagnoseReport:
    """Read, validate and diagnose: the report `tpsim diagnose` prints. `layer_ids`: ids in
    `convention` naming the slots by position: vLLM's `eagle_aux_hidden_state_layer_ids` for a vLLM
    file, any convention's for a tpsim capture (`num_layers`, or the reference's metadata, only bounds
    them; tpsim.offline.capture_read)."""
    L = reference_num_layers(reference, num_layers) if layer_ids is not None else None
    rs = read_run(files, step, points, layer_ids, L, convention)
    ref = read_reference(reference, positions, hidden)
    check_tokens(rs, ref)
    if points:
        points = [rs.aliases.get(p, p) for p in points]
        if len(set(points)) != len(points):
            raise UsageError("--point names a point twice; name each once")
        for p in points:
            if p not in rs.points:
                raise unknown_point(p, rs.available)
    names = points or [p for p in rs.points if rs.points[p][0].is_floating_point()]
    integer = [p for p in (points or rs.points) if not rs.points[p][0].is_floating_point()]
    if points and integer:  # ids or positions are not hidden states: a diff of them means nothing
        raise UsageError(f"point {integer[0]} holds {str(rs.points[integer[0]][0].dtype).removeprefix('torch.')} "
                         "values, not hidden states; name a floating-point point")
    if integer:
        rs.notes.append(f"skipped points holding integers, not hidden states: {', '.join(integer)}")
    if not names:
        raise UsageError("the rank files hold no point present on every rank")
    for p in names:
        check_consistent(rs, p)
    rows = []
    for p in names:
        ts, nonfinite = rs.points[p], rs.nonfinite(p)
        v = Verdict(asked_name(rs, ref, p), UNEXPLAINED, None, False, math.nan, f"not finite: {nonfinite}") \
            if nonfinite else diagnose_tensors(ts, ref.candidates, asked_name(rs, ref, p))
        declared, cand = rs.declared.get(p), ref.candidates.get(v.matches or v.point)
        others = [cand] if cand is not None else list(ref.candidates.values())
        rows.append(PointRow(p, v.placement, v.matches, v.correct, v.diff if math.isfinite(v.diff) else None,
                             v.reason, v.point, len(ts), [list(t.shape) for t in ts],
                             str(ts[0].dtype).removeprefix("torch."),
                             match_threshold(ts[0].dtype, *(c.dtype for c in others)), identical(ts), declared,
                             None if declared is None or v.placement == UNEXPLAINED else declared == v.placement))
    _aliased(rows)
    absent = [p for p in names if asked_name(rs, ref, p) not in ref.candidates]
    notes = rs.notes + ([f"the reference has nothing named like {len(absent)} of the points ({', '.join(absent)}): "
                         f"they can only match another candidate"] if absent else [])
    return DiagnoseReport(rs.files, rs.kind, rs.tp, None if rs.input_ids is None else len(rs.input_ids),
                          {"path": ref.path, "kind": ref.kind, "candidates": list(ref.candidates)}, notes, rows)


