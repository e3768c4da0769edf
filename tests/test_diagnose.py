"""`tpsim diagnose`: the placement and position of what each rank captured.

1. `diagnose_tensors` recovers the true placement (Replicate(), Partial(sum), Shard(dim=0) even
   and uneven, Shard(dim=-1)) and candidate (the asked one or another) of drawn tensors, and
   calls unrelated tensors unexplained (Hypothesis).
2. Genuine per-rank tensors from real gloo collectives (partial sums before an all-reduce,
   reduce-scatter shards, column-parallel shards, all-reduced and all-gathered results).
3. The readers: tpsim rank dumps, the three SGLang dumper layouts, capture / rank-dump /
   feature references; the CLI end to end in subprocesses, every bad input exit 2 with one line.
4. vLLM's hidden-states connector files (tpsim captures written in vLLM's layout): the gathered
   copy against vLLM-file and capture references, any slot mix-up named (Hypothesis), bad input.
5. `--layer-ids`: a vLLM file's slots named by vLLM's layer ids, so a capture in another convention
   (SGLang's) names them; drawn ids right and off by one (Hypothesis), bad input.
6. A tpsim capture file as the run: its slots named by the positions it recorded, or by `--layer-ids`
   in `--convention` (a trainer's ids name what the draft was trained on), bad input.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import diagnose_jobs
from clirun import assert_one_line_error, run_cli, run_clis
from tpsim.base.safetensors import tensor_sha256
from tpsim.offline.diagnosis import UNEXPLAINED, calc_diff, diagnose_files, diagnose_tensors, match_threshold
from tpsim.offline.capture_read import read_rank_files
from tpsim.offline.dumps import DumpKind
from tpsim.offline.reference import read_reference
from tpsim.parallel.placement import P, R, S0, S1
from tpsim.base.errors import UsageError

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --- 1. calc_diff and drawn placements ---------------------------------------------------------

def test_calc_diff_values():
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    assert calc_diff(x, x) == 0.0
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, torch.zeros_like(x)) == pytest.approx(1.0)
    assert calc_diff(torch.zeros(3, 3), torch.zeros(3, 3)) == 0.0
    for c in (0.5, 2.0, 4.0):  # scale-aware: (1-c)^2 / (1+c^2); tp=2 equal halves: 0.2
        assert calc_diff(c * x, x) == pytest.approx((1 - c) ** 2 / (1 + c * c))
    assert calc_diff(x.bfloat16(), x) < 1e-4  # bf16 rounding alone stays far below the 1e-3 threshold
    assert match_threshold(torch.float32) == 1e-5 and match_threshold(torch.float32, torch.bfloat16) == 1e-3
    with pytest.raises(ValueError):
        calc_diff(x, x.T)


@dataclass(frozen=True)
class Case:
    tp: int
    dtype: str
    placement: str      # R, P, S0, S1, or UNEXPLAINED (unrelated tensors)
    T: int
    width: int          # per-rank width for S1, full width otherwise
    n: int              # candidates
    truth: int          # the candidate the ranks hold
    asked: int          # the candidate the user asked for
    rows: tuple         # S0: rows per rank
    noise: bool         # round-off noise (else exact copies / slices)
    seed: int
    delta: float        # how far apart consecutive candidates are (out(k+1) = out(k) + delta * noise)
    scale: float = 1.0  # magnitude of every tensor (calc_diff is scale-free)


@st.composite
def cases(draw) -> Case:
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]), label="tp")
    placement = draw(st.sampled_from([R, UNEXPLAINED] if tp == 1 else [R, P, S0, S0, S1, UNEXPLAINED]),
                     label="placement")
    T, rows = draw(st.integers(1, 12), label="T"), ()
    if placement == S0 and draw(st.booleans(), label="even"):
        T = tp * draw(st.integers(1, 3))
        rows = (T // tp,) * tp
    elif placement == S0:  # uneven, some ranks possibly empty
        cuts = sorted(draw(st.lists(st.integers(0, T), min_size=tp - 1, max_size=tp - 1), label="cuts"))
        rows = tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))
    n = draw(st.integers(2, 4), label="candidates")
    return Case(tp, draw(st.sampled_from(sorted(DT)), label="dtype"), placement, T,
                draw(st.integers(1, 6), label="width"), n, draw(st.integers(0, n - 1), label="truth"),
                draw(st.integers(0, n - 1), label="asked"), rows, draw(st.booleans(), label="noise"),
                draw(st.integers(0, 2**31 - 1), label="seed"), draw(st.floats(0.5, 1.5), label="delta"),
                10.0 ** draw(st.integers(-3, 3), label="log10 scale"))


def candidates(case: Case, W: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """embed, out(0), ...: a chain of correlated residual-stream-like tensors `[T, W]` (a shared
    offset per column), then a distractor `q` as wide as one rank's shard (`[T, width]`)."""
    names = ["embed", *(f"out({k})" for k in range(case.n - 1))]
    x = torch.randn(case.T, W, generator=g, dtype=torch.float64) * 3 + torch.randn(1, W, generator=g)
    out = {}
    for name in names:
        out[name] = (case.scale * x).to(DT[case.dtype])
        x = x + case.delta * 3 * torch.randn(case.T, W, generator=g, dtype=torch.float64)
    out["q"] = (case.scale * torch.randn(case.T, case.width, generator=g)).to(DT[case.dtype])
    return out


def rounding(t: torch.Tensor, g: torch.Generator, on: bool) -> torch.Tensor:
    """t with relative noise up to half an ulp of its dtype (then rounded to it again)."""
    if not on:
        return t.clone()
    eps = torch.finfo(t.dtype).eps / 2
    return (t.double() * (1 + eps * (2 * torch.rand(t.shape, generator=g, dtype=torch.float64) - 1))).to(t.dtype)


def build(case: Case) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(case.seed)
    W = case.width * case.tp if case.placement == S1 else case.width
    ref = candidates(case, W, g)
    full = list(ref.values())[case.truth]
    tp, dt = case.tp, full.dtype
    if case.placement == R:
        ranks = [rounding(full, g, case.noise and r > 0) for r in range(tp)]
    elif case.placement == P:  # parts = full * (1/tp + z_r), sum_r z_r = 0: each part far from full
        z = torch.randn(tp, *full.shape, generator=g, dtype=torch.float64)
        parts = full.double() * (1 / tp + z - z.mean(0))
        ranks = [p.to(dt) for p in parts]
    elif case.placement == S0:
        ranks = [rounding(s, g, case.noise) for s in full.split(list(case.rows), dim=0)]
    elif case.placement == S1:
        ranks = [rounding(s, g, case.noise) for s in full.chunk(tp, dim=-1)]
    else:
        ranks = [(case.scale * torch.randn(case.T, W, generator=g)).to(dt) for _ in range(tp)]
    return ranks, ref


EXAMPLES = [  # Case(tp, dtype, placement, T, width, n, truth, asked, rows, noise, seed, delta)
    Case(8, "bfloat16", S0, 3, 2, 3, 1, 2, (0, 0, 1, 0, 2, 0, 0, 0), True, 1, 0.5),   # mostly empty token shards
    Case(3, "bfloat16", P, 1, 1, 2, 0, 0, (), False, 7, 0.5),                           # a lone element, 3 summands
    Case(2, "float32", S1, 1, 1, 4, 3, 0, (), True, 3, 1.5),                            # [1, 1] halves, wrong layer
    Case(1, "float32", R, 1, 1, 2, 1, 1, (), False, 0, 0.5),
    Case(2, "bfloat16", R, 1, 3, 3, 0, 0, (), True, 0, 1.0),  # found: [x, x] also read as x padded to 6 columns
]


def _premise(case: Case, ranks, ref) -> None:
    """Distinct candidates are far apart (a wrong layer gives >= 1e-2), no partial sum looks like
    the whole, and unrelated ranks are big enough not to match anything by chance."""
    vals = list(ref.values())
    assume(min((calc_diff(a, b) for i, a in enumerate(vals) for b in vals[i + 1:] if a.shape == b.shape),
               default=1) > 1e-2)
    if case.placement == P:
        assume(min(calc_diff(r, vals[case.truth]) for r in ranks) > 1e-2)
    if case.placement == UNEXPLAINED:
        assume(case.T * ranks[0].shape[1] >= 8)


@example(case=EXAMPLES[0])
@example(case=EXAMPLES[1])
@example(case=EXAMPLES[2])
@example(case=EXAMPLES[3])
@example(case=EXAMPLES[4])
@given(case=cases())
def test_recovers_placement_and_candidate(case: Case):
    ranks, ref = build(case)
    _premise(case, ranks, ref)
    names = list(ref)
    v = diagnose_tensors(ranks, ref, names[case.asked])
    assert v.point == names[case.asked]
    if case.placement == UNEXPLAINED:
        assert (v.placement, v.matches, v.correct) == (UNEXPLAINED, None, False), v
        assert v.diff > match_threshold(ranks[0].dtype), v
        return
    assert (v.placement, v.matches) == (case.placement, names[case.truth]), v
    assert v.correct == (case.placement == R and case.truth == case.asked), v
    assert v.diff <= match_threshold(ranks[0].dtype), v
    if case.truth != case.asked:
        assert f"this is {names[case.truth]}, you asked for {names[case.asked]}" in v.reason, v
    if case.placement == R and case.tp > 1:
        assert ("bitwise identical on all" in v.reason) == all(torch.equal(r, ranks[0]) for r in ranks), v


def test_partial_and_shard_wording():
    full = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    ref = {"out(1)": full, "out(2)": 2 * full + 1}
    v = diagnose_tensors([full / 4 + k - 1.5 for k in range(4)], ref, "out(1)")
    assert v.placement == P and "captured before an all-reduce (per-rank partial sums)" in v.reason
    v = diagnose_tensors(list(full.split([4, 2])), ref, "out(1)")
    assert v.placement == S0 and "each rank holds only its share of the tokens (rows 4+2)" in v.reason
    padded = torch.cat([full, torch.zeros(6, 4)], dim=1)  # a padded vocab: 12 columns, 8 real
    v = diagnose_tensors(list(padded.chunk(4, dim=1)), ref, "out(1)")
    assert (v.placement, v.matches, v.correct) == (S1, "out(1)", False) and "4 columns padding" in v.reason
    v = diagnose_tensors([full[:2]] * 2, ref, "out(1)")
    assert v.placement == UNEXPLAINED and v.diff == float("inf") and "no placement fits" in v.reason
    v = diagnose_tensors([full], {"out(2)": full}, "out(1)")  # a name the reference lacks
    assert (v.placement, v.matches, v.correct) == (R, "out(2)", False) and "reference has no out(1)" in v.reason


# --- 2. real collectives ---------------------------------------------------------------------

def test_genuine_collectives(rank_pool):
    kw = dict(seed=5, T=16, d_in=32, H=24, dtypes=["float32", "bfloat16"], tps=[1, 2, 4, 8])
    out = rank_pool.run(diagnose_jobs.collectives_job, **kw)
    for dtype in kw["dtypes"]:
        t = diagnose_jobs.inputs(kw["seed"], kw["T"], kw["d_in"], kw["H"], dtype)
        ref = {"row": t["x"] @ t["w_row"].T, "col": t["x"] @ t["w_col"].T}  # TP=1, in process
        for tp in kw["tps"]:
            got = {k: [out[r][tp, dtype][k] for r in range(tp)] for k in out[0][tp, dtype]}
            expect = {"partial": (P if tp > 1 else R, "row"), "reduced": (R, "row"), "gathered": (R, "col"),
                      "scattered": (S0 if tp > 1 else R, "row"), "local": (S1 if tp > 1 else R, "col")}
            for k, (placement, name) in expect.items():
                asked = "col" if name == "row" else "row"  # every point also asked for the other one
                for a in (name, asked):
                    v = diagnose_tensors(got[k], ref, a)
                    assert (v.placement, v.matches) == (placement, name), (tp, dtype, k, v)
                    assert v.correct == (placement == R and a == name), (tp, dtype, k, v)
            v = diagnose_tensors(got["reduced"], ref, "row")
            assert tp == 1 or "bitwise identical on all" in v.reason, v  # an all-reduce replicates bit for bit
            assert diagnose_tensors(got["reduced"], ref, "col").reason.startswith(
                "replicated, but this is row, you asked for col")


# --- 3. files: writers in the documented formats ---------------------------------------------

T, H = 12, 16
IDS = list(range(3, 3 + T))


def chain(seed: int = 0) -> dict[str, torch.Tensor]:
    """embed, out(0..2) and layer 1's o_proj output, float32 `[T, H]`."""
    g = torch.Generator().manual_seed(seed)
    x, out = torch.randn(T, H, generator=g), {}
    for name in ("embed", "out(0)", "out(1)", "out(2)", "o1"):
        out[name] = x
        x = x + torch.randn(T, H, generator=g)
    return out


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata={**meta, **{f"sha256.{k}": tensor_sha256(v) for k, v in tensors.items()}})
    return path


POSITION = {"embed.out": "embed", "layers.0.out": "out(0)", "layers.1.out": "out(1)", "layers.2.out": "out(2)"}


def rank_dump(d: Path, stem: str, tp: int, points: dict[str, tuple[list[torch.Tensor], str]],
              ids=IDS) -> list[Path]:
    """`{stem}.rank{r}.safetensors` per rank: point -> (per-rank tensors, declared placement)."""
    paths = []
    for r in range(tp):
        meta = {"format": "tpsim-rank-dump", "rank": str(r), "tp": str(tp),
                "points": ",".join(points)}
        for p, (_, placement) in points.items():
            meta[f"placement.{p}"] = placement
            if p in POSITION:
                meta[f"position.{p}"] = POSITION[p]
        tensors = {p: ts[r] for p, (ts, _) in points.items()}
        paths.append(save(d / f"{stem}.rank{r}.safetensors", {**tensors, "input_ids": torch.tensor(ids)}, meta))
    return paths


def parts(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    z = torch.randn(tp, *full.shape, generator=torch.Generator().manual_seed(9))
    return list(full * (1 / tp + z - z.mean(0)))


SGLANG_STEP = {"old": "forward_pass_id", "mid": "curr_step", "new": "step"}


def sglang_files(d: Path, layout: str, tp: int, dumps: dict[int, list[torch.Tensor]], ids=IDS, steps=(1,)):
    """SGLang dumper files of `layer_start__hidden_states` (layer_id -> per-rank tensors) and
    input_ids, in each layout read in sgl-project/sglang's dumper.py: old (5a7255c6) a bare tensor;
    mid (09d99f36, outside SGLang: no tp_rank) and new (00d35548) {"value", "meta"}."""
    d.mkdir(parents=True, exist_ok=True)
    for step in steps:
        for r in range(tp):
            items = [("input_ids", None, torch.tensor(ids))] + [("layer_start__hidden_states", k, ts[r])
                                                                 for k, ts in dumps.items()]
            for i, (name, k, value) in enumerate(items, start=1):
                if layout == "old":
                    tags = {"forward_pass_id": step, "rank": r, "name": name, "dump_index": i}
                else:
                    tags = {SGLANG_STEP[layout]: step, "rank": r, "dump_index": i, "name": name,
                            **({"recompute_status": "disabled"} if layout == "new" else {})}
                if k is not None:
                    tags["layer_id"] = k
                info = ({"tp_rank": r, "tp_size": tp, "pp_rank": 0, "pp_size": 1} if layout == "new"
                        else {"distributed_error": True, "dp_attention_error": True})
                obj = value if layout == "old" else {"value": value, "meta": {**tags, "world_rank": r, "world_size": tp,
                                                                              "sglang_parallel_info": info}}
                torch.save(obj, d / ("___".join(f"{a}={b}" for a, b in tags.items()) + ".pt"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("diagnose")
    c = chain()
    f = {"dir": d}
    f["cap"] = save(d / "cap.safetensors", {"aux_hidden_states": torch.cat([c["embed"], c["out(1)"], c["out(2)"]], 1),
                                            "input_ids": torch.tensor(IDS)},
                    {"positions": "embed,out(1),out(2)", "tp": "1", "dtype": "float32", "placement": "Replicate()"})
    # a capture's tensor without its positions: not a run diagnose can name (nor a rank dump)
    f["cap_unnamed"] = save(d / "cap_unnamed.safetensors", {"aux_hidden_states": torch.randn(T, 3 * H),
                                                            "input_ids": torch.tensor(IDS)}, {"tp": "1"})
    f["cap_long"] = save(d / "cap_long.safetensors",
                         {"aux_hidden_states": torch.randn(T + 1, 3 * H), "input_ids": torch.arange(T + 1)},
                         {"positions": "embed,out(1),out(2)"})
    f["ref1"] = rank_dump(d, "ref", 1, {"embed.out": ([c["embed"]], R), "layers.0.out": ([c["out(0)"]], R),
                                        "layers.1.out": ([c["out(1)"]], R), "layers.2.out": ([c["out(2)"]], R),
                                        "layers.1.attn.o_proj.partial": ([c["o1"]], R)})[0]
    rep = lambda t, n=4: [t.clone() for _ in range(n)]  # noqa: E731
    f["good"] = rank_dump(d, "good", 4, {"embed.out": (rep(c["embed"]), R), "layers.1.out": (rep(c["out(1)"]), R),
                                         "layers.2.out": (rep(c["out(2)"]), R)})
    f["bad"] = rank_dump(d, "bad", 4, {
        "layers.1.attn.o_proj.partial": (parts(c["o1"], 4), P),
        "layers.1.out": (list(c["out(1)"].split([4, 4, 2, 2])), R),   # token-sharded, declared Replicate()
        "layers.2.out": (rep(c["out(1)"]), R),                        # the wrong layer
        "embed.out": (list(c["embed"].chunk(4, -1)), S1)})
    f["shape"] = rank_dump(d, "shape", 2, {"layers.1.out": ([c["out(1)"], c["out(1)"][:, :8]], R)})
    f["dtype"] = rank_dump(d, "dtype", 2, {"layers.1.out": ([c["out(1)"], c["out(1)"].bfloat16()], R)})
    f["tp3"] = rank_dump(d, "tp3", 3, {"layers.1.out": (rep(c["out(1)"], 3), R)})
    f["ids"] = rank_dump(d, "ids", 2, {"layers.1.out": (rep(c["out(1)"], 2), R)})
    f["ids"][1] = rank_dump(d, "other", 2, {"layers.1.out": (rep(c["out(1)"], 2), R)}, ids=IDS[::-1])[1]
    f["dup"] = [*f["good"], rank_dump(d, "again", 4, {"layers.1.out": (rep(c["out(1)"]), R)})[0]]
    f["corrupt"] = d / "corrupt.rank1.safetensors"
    raw = bytearray(f["good"][1].read_bytes())
    raw[-1] ^= 0xFF  # the last byte is tensor data: the checksum must catch it
    f["corrupt"].write_bytes(bytes(raw))
    f["junk"] = d / "junk.rank0.safetensors"
    f["junk"].write_text("not a safetensors file\n")
    f["truncated"] = d / "truncated.rank0.safetensors"
    f["truncated"].write_bytes(f["good"][0].read_bytes()[:100])
    sglang_files(d / "sgl_old", "old", 2, {0: rep(c["embed"], 2), 2: rep(c["out(1)"], 2), 3: parts(c["out(2)"], 2)})
    sglang_files(d / "sgl_mid", "mid", 2, {0: rep(c["embed"], 2), 2: rep(c["out(1)"], 2)})
    sglang_files(d / "sgl_new", "new", 2, {0: rep(c["embed"], 2), 2: list(c["out(1)"].split([7, 5])),
                                           3: rep(c["out(1)"], 2)}, steps=(1, 2))
    feats = torch.cat([c["embed"], c["out(1)"], c["out(2)"]], 1).bfloat16()[None]
    f["feat"] = d / "feat.ckpt"  # SpecForge's offline record
    torch.save({"input_ids": torch.tensor(IDS), "loss_mask": torch.ones(T, dtype=torch.long),
                "aux_hidden_state": feats, "hidden_state": torch.randn(1, T, H).bfloat16()}, f["feat"])
    return f


def verdicts(report: dict) -> dict[str, tuple]:
    return {r["point"]: (r["placement"], r["matches"], r["correct"]) for r in report["points"]}


def test_read_tpsim_rank_dumps(files):
    rs = read_rank_files([str(p) for p in files["bad"]])
    assert (rs.kind, rs.tp, rs.input_ids.tolist()) == ("tpsim rank dump", 4, IDS)
    assert [t.shape[0] for t in rs.points["layers.1.out"]] == [4, 4, 2, 2]
    assert rs.position["layers.2.out"] == "out(2)" and rs.declared["embed.out"] == S1
    ref = read_reference(str(files["ref1"]), None, None)
    assert ref.kind == "TP=1 rank dump" and ref.candidates["out(1)"] is ref.candidates["layers.1.out"]
    cap = read_reference(str(files["cap"]), None, None)
    assert list(cap.candidates) == ["embed", "out(1)", "out(2)"] and cap.input_ids.tolist() == IDS
    assert torch.equal(cap.candidates["out(1)"], chain()["out(1)"])


@pytest.mark.parametrize("layout", ["old", "mid", "new"])
def test_read_sglang_dumps(files, layout):
    d = files["dir"] / f"sgl_{layout}"
    rs = read_rank_files([str(d)], step=2 if layout == "new" else None)
    assert (rs.kind, rs.tp, rs.input_ids.tolist()) == ("SGLang dumper", 2, IDS)
    key = "layer_start__hidden_states[layer_id={}]".format
    assert rs.position == {key(0): "embed", key(2): "out(1)", **({} if layout == "mid" else {key(3): "out(2)"})}
    assert [t.shape for t in rs.points[key(2)]] == ([(7, 16), (5, 16)] if layout == "new" else [(12, 16)] * 2)
    if layout == "new":
        with pytest.raises(UsageError, match="span steps 1, 2"):
            read_rank_files([str(d)])


def test_point_selection_reads_only_those(files):
    rep = diagnose_files([str(p) for p in files["bad"]], str(files["cap"]), points=["layers.2.out"]).to_dict()
    assert verdicts(rep) == {"layers.2.out": (R, "out(1)", False)}
    rep = diagnose_files([str(p) for p in files["bad"]], str(files["cap"])).to_dict()  # no o_proj output in a capture
    row = next(r for r in rep["points"] if r["point"] == "layers.1.attn.o_proj.partial")
    assert row["placement"] == UNEXPLAINED and row["declared_agrees"] is None, row  # no evidence either way
    assert "nothing named like 1 of the points (layers.1.attn.o_proj.partial)" in rep["notes"][0]
    key = "layer_start__hidden_states[layer_id={}]".format
    rs = read_rank_files([str(files["dir"] / "sgl_old")], points=[key(3)])
    assert list(rs.points) == [key(3)] and rs.input_ids.tolist() == IDS
    with pytest.raises(UsageError, match=re.escape(f"(points: {key(0)}, {key(2)}, {key(3)})")):
        diagnose_files([str(files["dir"] / "sgl_old")], str(files["cap"]), points=["nope"])


def test_read_training_features(files):
    ref = read_reference(str(files["feat"]), ["embed", "out(1)", "out(2)"], None)
    assert ref.kind == "training features" and ref.candidates["out(2)"].dtype == torch.bfloat16
    assert list(read_reference(str(files["feat"]), None, H).candidates) == ["slot0", "slot1", "slot2"]
    with pytest.raises(UsageError, match="--positions"):
        read_reference(str(files["feat"]), None, None)
    with pytest.raises(UsageError, match="--hidden-size 10"):
        read_reference(str(files["feat"]), ["embed", "out(1)", "out(2)"], 10)


# --- 3b. the CLI end to end ------------------------------------------------------------------

def good_runs(f) -> dict[str, list]:
    ref, cap = ["--reference", f["ref1"]], ["--reference", f["cap"]]
    return {
        "good_vs_cap": [*f["good"], *cap],
        "good_vs_features_json": [*f["good"], "--reference", f["feat"], "--positions", "embed,out(1),out(2)", "--json"],
        "bad_vs_ref1_text": [*f["bad"], *ref],
        "sglang_old_vs_cap_text": [f["dir"] / "sgl_old", *cap],
        "sglang_new_vs_cap_json": [f["dir"] / "sgl_new", *cap, "--step", "2", "--json"],
    }


BAD = {  # id -> (argv from the files, substrings of the one error line)
    "inconsistent-shapes": (lambda f: [*f["shape"], "--reference", f["cap"]], ("layers.1.out", "[12, 8]")),
    "inconsistent-dtypes": (lambda f: [*f["dtype"], "--reference", f["cap"]], ("bfloat16", "float32")),
    "missing-rank": (lambda f: [f["tp3"][0], f["tp3"][2], "--reference", f["cap"]], ("rank 1 of tp=3 is missing",)),
    "two-files-one-rank": (lambda f: [*f["dup"], "--reference", f["cap"]], ("two files for rank 0",)),
    "different-input-ids": (lambda f: [*f["ids"], "--reference", f["cap"]], ("other input_ids", "different runs")),
    "reference-token-count": (lambda f: [*f["good"], "--reference", f["cap_long"]], ("13 tokens", "rank files 12")),
    "missing-file": (lambda f: [f["good"][0], f["dir"] / "nope.rank1.safetensors", "--reference", f["cap"]],
                     ("nope.rank1.safetensors", "does not exist")),
    "missing-reference": (lambda f: [*f["good"], "--reference", f["dir"] / "nope.safetensors"],
                          ("--reference", "does not exist")),
    "not-safetensors": (lambda f: [f["junk"], "--reference", f["cap"]], ("junk.rank0", "not a readable safetensors")),
    "truncated": (lambda f: [f["truncated"], "--reference", f["cap"]], ("truncated.rank0", "not a readable")),
    "checksum": (lambda f: [f["good"][0], f["corrupt"], *f["good"][2:], "--reference", f["cap"]],
                 ("corrupt.rank1", "sha256")),
    "unknown-point": (lambda f: [*f["good"], "--reference", f["cap"], "--point", "layers.9.out"],
                      ("--point layers.9.out", "layers.1.out")),
    "not-a-rank-dump": (lambda f: [f["cap_unnamed"], "--reference", f["cap"]], ("not a tpsim rank dump",)),
    "capture-with-step": (lambda f: [f["cap"], "--reference", f["cap"], "--step", "0"],
                          ("--step picks a forward pass among SGLang dumper files",)),
    "bad-positions": (lambda f: [*f["good"], "--reference", f["feat"], "--positions", "embed,layer2"],
                      ("--positions", "'layer2'")),
    "sglang-steps": (lambda f: [f["dir"] / "sgl_new", "--reference", f["cap"]], ("--step",)),
}


class Runs:
    """Every CLI run of this module, started before the module's first test (two at a time, so they
    overlap the in-process tests and the rank pool): `runs[key]` waits for one."""

    def __init__(self, files: dict[str, Path]):
        self.dir = files["dir"]
        self.before = self.snapshot()
        argv = {**{k: ["diagnose", *a] for k, a in good_runs(files).items()},
                **{f"bad:{k}": ["diagnose", *make(files)] for k, (make, _) in BAD.items()}}
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures = {k: self.pool.submit(run_cli, *a) for k, a in argv.items()}

    def snapshot(self) -> list:
        return sorted((str(p), p.stat().st_mtime_ns) for p in self.dir.rglob("*"))

    def __getitem__(self, key: str):
        return self.futures[key].result()


@pytest.fixture(scope="module", autouse=True)
def cli(files):
    runs = Runs(files)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2(cli, case):
    assert_one_line_error(cli[f"bad:{case}"], BAD[case][1])
    assert cli.snapshot() == cli.before  # nothing written (nor by any other run)


def test_cli_all_replicated_and_correct(cli, files):
    r = cli["good_vs_cap"]
    assert r.returncode == 0, r
    for s in ("4 rank files (tpsim rank dump, tp=4, 12 tokens)", "capture file", "1e-05", "1e-03",
              "bitwise identical on all 4 ranks", "PASS"):
        assert s in r.stdout, (s, r)
    rep = diagnose_files([str(p) for p in files["good"]], str(files["ref1"])).to_dict()  # the report --json prints
    assert rep["ok"]
    assert verdicts(rep) == {p: (R, p, True) for p in ("embed.out", "layers.1.out", "layers.2.out")}
    assert all(r["ranks_identical"] and r["declared_agrees"] for r in rep["points"])


def test_cli_bf16_features_reference(cli):
    r = cli["good_vs_features_json"]
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["reference"]["kind"] == "training features", r
    assert verdicts(rep) == {"embed.out": (R, "embed", True), "layers.1.out": (R, "out(1)", True),
                             "layers.2.out": (R, "out(2)", True)}
    assert {p["threshold"] for p in rep["points"]} == {1e-3} and max(p["diff"] for p in rep["points"]) < 1e-4


def test_cli_every_failure_named(cli, files):
    rep = diagnose_files([str(p) for p in files["bad"]], str(files["ref1"])).to_dict()
    assert verdicts(rep) == {
        "layers.1.attn.o_proj.partial": (P, "layers.1.attn.o_proj.partial", False),
        "layers.1.out": (S0, "layers.1.out", False),
        "layers.2.out": (R, "layers.1.out", False),
        "embed.out": (S1, "embed.out", False)}
    agree = {p["point"]: p["declared_agrees"] for p in rep["points"]}
    assert agree == {"layers.1.attn.o_proj.partial": True, "layers.1.out": False, "layers.2.out": True,
                     "embed.out": True}
    text = cli["bad_vs_ref1_text"]
    assert text.returncode == 1, text
    for s in ("captured before an all-reduce (per-rank partial sums)", "each rank holds only its share of the tokens",
              "this is layers.1.out, you asked for layers.2.out", "Shard(dim=0) (declared Replicate())",
              "FAIL: 4 of 4"):
        assert s in text.stdout, (s, text)


def test_cli_sglang_dumps(cli):
    old, new = cli["sglang_old_vs_cap_text"], cli["sglang_new_vs_cap_json"]
    assert old.returncode == 1 and new.returncode == 1, (old, new)
    key = "layer_start__hidden_states[layer_id={}]".format
    cells = [re.split(r"\s{2,}", line.strip()) for line in old.stdout.splitlines()]
    rows = {c[0]: c[2:6] for c in cells if c[0].startswith("layer_start__hidden_states[")}
    assert rows == {key(0): [R, "embed", "0.00e+00", "yes"], key(2): [R, "out(1)", "0.00e+00", "yes"],
                    key(3): [P, "out(2)", rows[key(3)][2], "NO"]}, old
    assert "note: the dumps carry no world size" in old.stdout and "FAIL: 1 of 3" in old.stdout, old
    assert verdicts(json.loads(new.stdout)) == {key(0): (R, "embed", True), key(2): (S0, "out(1)", False),
                                                key(3): (R, "out(1)", False)}


# --- 4. vLLM's hidden-states connector ---------------------------------------------------------
# vllm-project/vllm, vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py
# (releases 0.17.0 to 0.33.0): `save_file({"hidden_states": [T, n, H], "token_ids": [T]}, filename)`,
# no metadata, one `{req_id}.safetensors` per request, one gathered copy for the TP group.
# The content here is tpsim's own: captures at TP=1 and TP=2 with vLLM's convention, rewritten
# in that layout.

VLLM_IDS = [1, 2, 3, 4]  # eagle_aux_hidden_state_layer_ids; vLLM captures before layer j: out(j-1)


def vllm_file(path: Path, hidden_states: torch.Tensor, token_ids: torch.Tensor) -> Path:
    save_file({"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.contiguous()}, str(path))
    return path


def as_vllm(capture: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A tpsim capture's `aux_hidden_states` `[T, n*H]` as vLLM's `[T, n, H]`, and its token ids."""
    t = load_file(str(capture))
    aux, ids = t["aux_hidden_states"], t["input_ids"]
    return aux.reshape(len(ids), len(VLLM_IDS), -1), ids


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("vllm")
    layers = ",".join(map(str, VLLM_IDS))
    argv = {tp: ["capture", "--tp", tp, "--convention", "vllm-ids", "--layers", layers, "--seq-len", T,
                 "--out", d / f"cap_tp{tp}.safetensors"] for tp in (1, 2)}
    for r in run_clis(argv).values():
        assert r.returncode == 0, r
    f = {"dir": d, "cap": d / "cap_tp1.safetensors"}
    hs1, ids = as_vllm(f["cap"])
    hs2, ids2 = as_vllm(d / "cap_tp2.safetensors")
    assert torch.equal(ids, ids2)
    slots = list(hs1.unbind(1))
    assert min(calc_diff(a, b) for i, a in enumerate(slots) for b in slots[i + 1:]) > 1e-2  # distinct slots
    f["ref"] = vllm_file(d / "ref.safetensors", hs1, ids)
    f["run"] = vllm_file(d / "run.safetensors", hs2, ids)
    f["swap"] = vllm_file(d / "swap.safetensors", hs2[:, [0, 2, 1, 3]], ids)
    f["run_bf16"] = vllm_file(d / "run_bf16.safetensors", hs2.bfloat16(), ids)
    meta = load_meta(f["cap"])
    f["cap_sglang"] = save(d / "cap_sglang.safetensors", load_file(str(f["cap"])), {**meta, "convention": "sglang-ids"})
    return f


def load_meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as fh:
        return {k: v for k, v in (fh.metadata() or {}).items() if not k.startswith("sha256.")}


SLOTS = [f"slot{i}" for i in range(len(VLLM_IDS))]


def test_read_vllm_file(vllm):
    rs = read_rank_files([str(vllm["run"])])
    assert (rs.kind, rs.kind.gathered, rs.tp, rs.files, rs.available) == (
        DumpKind.VLLM, True, 1, [str(vllm["run"])], SLOTS)
    hs, ids = as_vllm(vllm["dir"] / "cap_tp2.safetensors")
    assert rs.input_ids.tolist() == ids.tolist()
    assert all(torch.equal(rs.points[s][0], hs[:, i]) for i, s in enumerate(SLOTS))
    assert rs.notes[0].startswith("gathered: vLLM's hidden-states connector writes one copy")
    assert list(read_rank_files([str(vllm["run"])], points=["slot2"]).points) == ["slot2"]
    ref = read_reference(str(vllm["ref"]), None, None)
    assert (ref.kind, list(ref.candidates)) == ("vLLM hidden-states file", SLOTS)
    named = read_reference(str(vllm["ref"]), ["out(0)", "out(1)", "out(2)", "out(3)"], None).candidates
    assert list(named) == ["out(0)", "out(1)", "out(2)", "out(3)", *SLOTS] and named["slot1"] is named["out(1)"]
    cap = read_reference(str(vllm["cap"]), None, None).candidates  # vLLM's convention: also answers to slot{i}
    assert list(cap) == ["out(0)", "out(1)", "out(2)", "out(3)", *SLOTS]
    assert list(read_reference(str(vllm["cap_sglang"]), None, None).candidates) == ["out(0)", "out(1)", "out(2)",
                                                                                  "out(3)"]


def test_vllm_gathered_copy_against_references(vllm):
    for ref in ("ref", "cap"):
        rep = diagnose_files([str(vllm["run"])], str(vllm[ref])).to_dict()
        assert rep["ok"] and (rep["kind"], rep["tp"], rep["tokens"]) == (DumpKind.VLLM, 1, T), rep
        assert verdicts(rep) == {s: (R, s, True) for s in SLOTS}, rep
        assert max(p["diff"] for p in rep["points"]) < 1e-10  # TP=2 round-off only
    rep = diagnose_files([str(vllm["run_bf16"])], str(vllm["cap"])).to_dict()  # vLLM writes the model dtype
    assert rep["ok"] and {p["threshold"] for p in rep["points"]} == {1e-3}, rep
    rep = diagnose_files([str(vllm["swap"])], str(vllm["cap"])).to_dict()
    assert verdicts(rep) == {"slot0": (R, "slot0", True), "slot1": (R, "out(2)", False),
                             "slot2": (R, "out(1)", False), "slot3": (R, "slot3", True)}, rep
    reasons = {p["point"]: p["reason"] for p in rep["points"]}
    assert reasons["slot1"].startswith("replicated, but this is out(2), you asked for slot1"), reasons
    rep = diagnose_files([str(vllm["run"])], str(vllm["cap_sglang"])).to_dict()  # slots unnamed in the reference
    assert verdicts(rep) == {s: (R, f"out({i})", False) for i, s in enumerate(SLOTS)}, rep
    assert "the reference has nothing named like 4 of the points (slot0, slot1, slot2, slot3)" in rep["notes"][1]


SHIFT, SWAP = [1, 2, 3], [1, 0]  # an off-by-one layer, a permutation


@example(src=SHIFT, dtype="float32")
@example(src=SWAP, dtype="bfloat16")
@given(src=st.lists(st.integers(0, len(VLLM_IDS) - 1), min_size=1, max_size=len(VLLM_IDS)),
       dtype=st.sampled_from(sorted(DT)))
def test_vllm_any_slot_mixup_is_named(vllm, tmp_path_factory, src, dtype):
    """Whatever reference slot each written slot holds, diagnose names it (slot i holding slot j:
    correct only when i == j), against a vLLM file and a capture in vLLM's convention."""
    hs, ids = as_vllm(vllm["dir"] / "cap_tp2.safetensors")
    run = vllm_file(tmp_path_factory.mktemp("mixup") / "req.safetensors", hs[:, src].to(DT[dtype]), ids)
    for ref in ("ref", "cap"):
        rep = diagnose_files([str(run)], str(vllm[ref])).to_dict()
        for i, j in enumerate(src):
            named = f"slot{j}" if ref == "ref" or i == j else f"out({j})"
            assert verdicts(rep)[f"slot{i}"] == (R, named, i == j), (ref, src, rep)
        assert rep["ok"] == (src == list(range(len(src))))


def write_bad_vllm(v: dict[str, Path]) -> None:
    """Files a bad input case below names: vLLM's layout broken one way each, a tpsim rank dump."""
    d, (hs, ids) = v["dir"], as_vllm(v["dir"] / "cap_tp2.safetensors")
    save_file({"hidden_states": hs.contiguous()}, str(d / "no_tokens.safetensors"))
    save_file({"token_ids": ids}, str(d / "no_hidden.safetensors"))
    vllm_file(d / "flat.safetensors", hs.flatten(1), ids)
    vllm_file(d / "short_ids.safetensors", hs, ids[:-1])
    vllm_file(d / "other_ids.safetensors", hs, ids.flip(0))
    rank_dump(d, "tpsim", 1, {"layers.0.out": ([hs[:, 0]], R)}, ids=ids.tolist())


REF = lambda v: ["--reference", v["ref"]]  # noqa: E731
VLLM_BAD = {  # id -> (argv from the files, substrings of the one error line)
    "two-requests": (lambda v: [v["run"], v["swap"], *REF(v)], ("2 vLLM hidden-states files", "one per request")),
    "mixed-formats": (lambda v: [v["run"], v["dir"] / "tpsim.rank0.safetensors", *REF(v)],
                      ("mix of tpsim rank dump and vLLM hidden-states connector",)),
    "missing-token-ids": (lambda v: [v["dir"] / "no_tokens.safetensors", *REF(v)],
                          ("has no token_ids tensor", "{req_id}")),
    "missing-hidden-states": (lambda v: [v["dir"] / "no_hidden.safetensors", *REF(v)], ("has no hidden_states",)),
    "not-3d": (lambda v: [v["dir"] / "flat.safetensors", *REF(v)], ("[12, 256]", "[tokens, aux layers, hidden]")),
    "token-count": (lambda v: [v["dir"] / "short_ids.safetensors", *REF(v)],
                    ("token_ids is int64 [11] for 12 tokens",)),
    "other-tokens": (lambda v: [v["dir"] / "other_ids.safetensors", *REF(v)], ("other input_ids",)),
    "unknown-slot": (lambda v: [v["run"], *REF(v), "--point", "slot9"], ("--point slot9", "slot0, slot1")),
    "reference-hidden-size": (lambda v: [v["run"], *REF(v), "--hidden-size", "32"],
                              ("--hidden-size 32", "hidden size 64")),
    "reference-positions": (lambda v: [v["run"], *REF(v), "--positions", "out(1),out(2)"],
                            ("--positions names 2 slots",)),
}


@pytest.fixture(scope="module")
def vllm_cli(vllm) -> dict:
    """Every vLLM CLI run of this module, two at a time."""
    write_bad_vllm(vllm)
    argv = {"text": [vllm["run"], "--reference", vllm["ref"]],
            "swap_json": [vllm["swap"], "--reference", vllm["cap"], "--json"],
            **{f"bad:{k}": make(vllm) for k, (make, _) in VLLM_BAD.items()}}
    return run_clis({k: ["diagnose", *a] for k, a in argv.items()})


def test_cli_vllm_says_gathered(vllm_cli):
    r = vllm_cli["text"]
    assert r.returncode == 0, r
    for s in ("tpsim diagnose: 1 file (vLLM hidden-states connector: gathered, one copy for every TP rank, "
              "12 tokens)", "note: gathered: vLLM's hidden-states connector writes one copy per request",
              "PASS: every slot of the gathered copy is the asked tensor"):
        assert s in r.stdout, (s, r)
    r = vllm_cli["swap_json"]
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["kind"] == "vLLM hidden-states connector" and rep["tp"] == 1, r
    assert [p["point"] for p in rep["points"] if not p["correct"]] == ["slot1", "slot2"], rep


@pytest.mark.parametrize("case", sorted(VLLM_BAD))
def test_cli_vllm_bad_input_is_one_line_exit_2(vllm_cli, case):
    assert_one_line_error(vllm_cli[f"bad:{case}"], VLLM_BAD[case][1])


# --- 5. --layer-ids: a vLLM file's slots named by the ids the server ran with ------------------
# vLLM's eagle_aux_hidden_state_layer_ids: id k is the residual stream entering layer k (embed for
# k = 0, else out(k-1)); SGLang's id j is out(j) (-1: embed). The file records neither, so by slot
# index a capture in SGLang's convention names none of its slots. Real captures of the tiny model
# (8 layers): every vLLM id at TP=2 in vLLM's convention, every position SGLang reaches at TP=1 in
# SGLang's, and out(0..3) (the `vllm` fixture's vLLM ids 1..4) at TP=1 in SGLang's.

TINY_LAYERS = 8
EVERY_VLLM_ID = list(range(TINY_LAYERS + 1))         # embed, out(0) .. out(7)
EVERY_SGLANG_ID = list(range(-1, TINY_LAYERS - 1))   # embed, out(0) .. out(6): SGLang's loop never reaches out(7)


def vllm_position(k: int) -> str:
    """What vLLM's id k captures, written out here rather than taken from tpsim."""
    return "embed" if k == 0 else f"out({k - 1})"


def csv(ids) -> str:
    return ",".join(map(str, ids))


@pytest.fixture(scope="module")
def layer_ids(vllm) -> dict:
    d = vllm["dir"]
    argv = {"every_vllm": ["--tp", 2, "--convention", "vllm-ids", f"--layers={csv(EVERY_VLLM_ID)}"],
            "every_sglang": ["--tp", 1, "--convention", "sglang-ids", "--layers", csv(EVERY_SGLANG_ID)],
            "sglang": ["--tp", 1, "--convention", "sglang-ids", "--layers", csv(k - 1 for k in VLLM_IDS)]}
    runs = run_clis({k: ["capture", *a, "--seq-len", T, "--out", d / f"{k}.safetensors"] for k, a in argv.items()})
    assert all(r.returncode == 0 for r in runs.values()), runs
    f = {k: d / f"{k}.safetensors" for k in argv}
    assert load_meta(f["sglang"])["positions"] == csv(vllm_position(k) for k in VLLM_IDS)
    assert load_meta(f["every_sglang"])["positions"] == csv(vllm_position(k) for k in EVERY_VLLM_ID[:-1])
    t = load_file(str(f["every_vllm"]))
    f["hs"], f["ids"] = t["aux_hidden_states"].reshape(T, len(EVERY_VLLM_ID), -1), t["input_ids"]
    slots = list(f["hs"].unbind(1))
    assert min(calc_diff(a, b) for i, a in enumerate(slots) for b in slots[i + 1:]) > 1e-2  # distinct positions
    return f


@example(ids=[4, 1, 3, 2], shift=1, dtype="float32", num_layers=None)   # the `vllm` fixture's ids, listed unsorted
@example(ids=[0, 7], shift=1, dtype="bfloat16", num_layers=TINY_LAYERS)  # shifted onto out(7): not in the reference
@example(ids=[1], shift=-1, dtype="float32", num_layers=TINY_LAYERS)     # shifted onto embed
@given(ids=st.lists(st.integers(0, TINY_LAYERS - 1), min_size=1, max_size=4, unique=True),
       shift=st.sampled_from([-1, 1]), dtype=st.sampled_from(sorted(DT)),
       num_layers=st.sampled_from([None, TINY_LAYERS]))
def test_layer_ids_name_each_slot(layer_ids, tmp_path_factory, ids, shift, dtype, num_layers):
    """A vLLM file holding the drawn ids' slots (ascending, as vLLM writes them) against a capture of
    every position in SGLang's convention: with the ids it was written with every slot is the asked
    tensor; with every id off by one each slot is named as the position it really holds."""
    assume(min(ids) + shift >= 0)
    run = vllm_file(tmp_path_factory.mktemp("layer_ids") / "req.safetensors",
                    layer_ids["hs"][:, sorted(ids)].to(DT[dtype]), layer_ids["ids"])
    ref = str(layer_ids["every_sglang"])
    rep = diagnose_files([str(run)], ref, layer_ids=ids, num_layers=num_layers).to_dict()
    assert rep["ok"] and verdicts(rep) == {vllm_position(k): (R, vllm_position(k), True) for k in sorted(ids)}, rep
    rep = diagnose_files([str(run)], ref, layer_ids=[k + shift for k in ids], num_layers=num_layers).to_dict()
    assert verdicts(rep) == {vllm_position(k + shift): (R, vllm_position(k), False) for k in ids}, rep
    assert [p["point"] for p in rep["points"]] == [vllm_position(k + shift) for k in sorted(ids)]
    for p in rep["points"]:
        asked = p["point"]
        assert (f"this is {p['matches']}, you asked for {asked}" if asked != "out(7)"
                else "(the reference has no out(7))") in p["reason"], p


def test_layer_ids_against_a_capture_in_sglang_convention(layer_ids, vllm):
    """The `vllm` fixture's TP=2 file (vLLM ids 1..4) against a TP=1 capture of the same positions in
    SGLang's convention: by slot index nothing is named; by --layer-ids every slot is the asked tensor."""
    run, ref = str(vllm["run"]), str(layer_ids["sglang"])
    assert verdicts(diagnose_files([run], ref).to_dict()) == {s: (R, f"out({i})", False) for i, s in enumerate(SLOTS)}
    rep = diagnose_files([run], ref, layer_ids=VLLM_IDS).to_dict()
    want = [vllm_position(k) for k in VLLM_IDS]
    assert rep["ok"] and verdicts(rep) == {p: (R, p, True) for p in want}, rep
    assert max(p["diff"] for p in rep["points"]) < 1e-10  # TP=2 round-off only
    assert "slot0 = out(0)" in rep["notes"][0], rep["notes"]
    rs = read_rank_files([run], layer_ids=[4, 3, 2, 1])  # any order: vLLM writes its slots ascending
    assert (list(rs.points), rs.available, rs.position) == (want, want, {p: p for p in want})
    assert rs.aliases == {s: p for s, p in zip(SLOTS, want)}
    sel = diagnose_files([run], ref, points=["slot1", "out(3)"], layer_ids=VLLM_IDS).to_dict()  # slot{i}: an alias
    assert verdicts(sel) == {"out(1)": (R, "out(1)", True), "out(3)": (R, "out(3)", True)}, sel
    for other in ("ref", "cap", "cap_sglang"):  # a vLLM file, captures in vLLM's and (relabelled) SGLang's convention
        rep = diagnose_files([run], str(vllm[other]), layer_ids=VLLM_IDS).to_dict()
        assert rep["ok"] and [p["point"] for p in rep["points"]] == want, (other, rep)
    with pytest.raises(UsageError, match=re.escape("--point names a point twice")):
        diagnose_files([run], ref, points=["slot0", "out(0)"], layer_ids=VLLM_IDS)
    # a position the reference lacks is asked by its position, not by a slot index the reference happens to have
    two = vllm_file(vllm["dir"] / "embed_out0.safetensors", layer_ids["hs"][:, [0, 1]], layer_ids["ids"])
    rep = diagnose_files([str(two)], str(vllm["cap"]), layer_ids=[0, 1]).to_dict()  # cap: out(0..3), slot0..3
    rows = {p["point"]: p for p in rep["points"]}
    assert verdicts(rep) == {"embed": (UNEXPLAINED, None, False), "out(0)": (R, "out(0)", True)}, rep
    assert rows["embed"]["asked"] == "embed" and "(the reference has no embed)" in rows["embed"]["reason"], rep


def test_layer_ids_num_layers_from_the_reference(layer_ids, vllm):
    """The range check takes num_layers from the reference capture's metadata when it has one."""
    run = str(vllm["run"])
    cap = save(vllm["dir"] / "sglang_L3.safetensors", load_file(str(layer_ids["sglang"])),
               {**load_meta(layer_ids["sglang"]), "num_layers": "3"})
    with pytest.raises(UsageError, match=re.escape("layer id 4 is out of range for vllm-ids with num_layers=3")):
        diagnose_files([run], str(cap), layer_ids=VLLM_IDS)
    with pytest.raises(UsageError, match=re.escape("--num-layers 8 differs from the reference's num_layers=3")):
        diagnose_files([run], str(cap), layer_ids=VLLM_IDS, num_layers=8)
    assert load_meta(layer_ids["sglang"])["num_layers"] == "8"  # tpsim captures record it
    assert diagnose_files([run], str(layer_ids["sglang"]), layer_ids=VLLM_IDS, num_layers=8).ok


RUN = lambda v, li, f: [v["run"], "--reference", li["sglang"]]  # noqa: E731
LAYER_IDS_BAD = {  # id -> (argv from the files, substrings of the one error line)
    "fewer-ids": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,3"],
                  ("--layer-ids 1,2,3 names 3 layers (out(0),out(1),out(2))", "holds 4 slots", "[12, 4, 64]")),
    "repeated-id": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,2,3"], ("names 3 distinct layers",)),
    "more-ids": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "0,1,2,3,4"], ("names 5 layers", "4 slots")),
    "negative-spaced": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "-1,2,3,4"],
                        ("--layer-ids -1,2,3,4", "layer id -1 is out of range for vllm-ids with num_layers=8")),
    "negative-equals": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids=-1,2,3,4", "--num-layers", "8"],
                        ("--layer-ids -1,2,3,4", "layer id -1 is out of range for vllm-ids with num_layers=8")),
    "out-of-range": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,3,9", "--num-layers", "8"],
                     ("layer id 9 is out of range for vllm-ids with num_layers=8", "valid 0..8")),
    "not-integers": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "out(0)"],
                     ("--layer-ids 'out(0)' is not a comma-separated list of integers",)),
    "num-layers-alone": (lambda v, li, f: [*RUN(v, li, f), "--num-layers", "8"], ("--num-layers", "--layer-ids")),
    "unknown-point": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,3,4", "--point", "slot9"],
                      ("--point slot9", "out(0), out(1)")),
    "tpsim-rank-dumps": (lambda v, li, f: [*f["good"], "--reference", f["cap"], "--layer-ids", "1,2,3"],
                         ("--layer-ids", "vLLM hidden-states file", "tpsim rank dump")),
    "sglang-dumps": (lambda v, li, f: [f["dir"] / "sgl_old", "--reference", f["cap"], "--layer-ids", "1,2,3"],
                     ("--layer-ids", "vLLM hidden-states file", "SGLang dumper")),
    "convention-alone": (lambda v, li, f: [li["sglang"], "--reference", li["every_sglang"], "--convention", "output-of"],
                         ("--convention numbers --layer-ids, which is not given",)),
    "convention-on-vllm": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,3,4", "--convention", "output-of"],
                           ("--convention output-of numbers --layer-ids for a tpsim capture file",)),
    "capture-fewer-ids": (lambda v, li, f: [li["sglang"], "--reference", li["every_sglang"], "--layer-ids", "1,2",
                                            "--convention", "output-of"],
                          ("--layer-ids 1,2 names 2 positions (out(1),out(2)) in --convention output-of",
                           "holds 4 slots")),
    "capture-out-of-range": (lambda v, li, f: [li["sglang"], "--reference", li["every_sglang"], "--layer-ids",
                                               "5,6,7,8", "--convention", "output-of"],
                             ("--layer-ids 5,6,7,8 (--convention output-of)", "out of range")),
    "profile-name-as-convention": (lambda v, li, f: [*RUN(v, li, f), "--layer-ids", "1,2,3,4", "--convention", "vllm"],
                                   ('--convention vllm: "vllm" names an engine profile', "write --convention vllm-ids")),
    "capture-with-another-file": (lambda v, li, f: [li["sglang"], li["every_sglang"], "--reference", li["sglang"]],
                                  ("is a tpsim capture (one copy for the whole TP group); pass it alone",)),
}


@pytest.fixture(scope="module")
def layer_ids_cli(vllm, layer_ids, files) -> dict:
    """Every --layer-ids CLI run of this module, two at a time."""
    argv = {"text": [*RUN(vllm, layer_ids, files), "--layer-ids", "1,2,3,4"],
            "json": [*RUN(vllm, layer_ids, files), "--layer-ids=4,3,2,1", "--num-layers", "8", "--json"],
            "by_index": [*RUN(vllm, layer_ids, files)],
            **{f"bad:{k}": make(vllm, layer_ids, files) for k, (make, _) in LAYER_IDS_BAD.items()}}
    return run_clis({k: ["diagnose", *a] for k, a in argv.items()})


def test_cli_layer_ids(layer_ids_cli):
    r = layer_ids_cli["text"]
    assert r.returncode == 0, r
    cells = [line.split() for line in r.stdout.splitlines()]
    rows = {c[0]: c[1:] for c in cells if c and re.fullmatch(r"out\(\d\)", c[0])}
    assert list(rows) == ["out(0)", "out(1)", "out(2)", "out(3)"] and all("yes" in c for c in rows.values()), r
    for s in ("slot0 = out(0)", "PASS: every slot of the gathered copy is the asked tensor"):
        assert s in r.stdout, (s, r)
    r = layer_ids_cli["json"]
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and verdicts(rep) == {f"out({i})": (R, f"out({i})", True) for i in range(4)}, r
    r = layer_ids_cli["by_index"]  # what --layer-ids fixes: by slot index every row says NO
    assert r.returncode == 1 and "FAIL: 4 of 4" in r.stdout, r


@pytest.mark.parametrize("case", sorted(LAYER_IDS_BAD))
def test_cli_layer_ids_bad_input_is_one_line_exit_2(layer_ids_cli, case):
    assert_one_line_error(layer_ids_cli[f"bad:{case}"], LAYER_IDS_BAD[case][1])


# --- 6. a tpsim capture file as the run ----------------------------------------------------------

def test_a_capture_file_names_its_slots_by_position(layer_ids):
    """The `sglang` capture (out(0..3)) against a capture of every position: named by what it recorded,
    every slot is the asked tensor; named by a trainer's ids one layer later (output-of 1..4, what a
    draft trained on out(1..4) declares), each slot is found one layer early, named by both layers."""
    run, ref = str(layer_ids["sglang"]), str(layer_ids["every_sglang"])
    rep = diagnose_files([run], ref).to_dict()
    assert rep["ok"] and rep["kind"] == DumpKind.CAPTURE and rep["tp"] == 1, rep
    assert verdicts(rep) == {f"out({k})": (R, f"out({k})", True) for k in range(4)}, rep
    rep = diagnose_files([run], ref, layer_ids=[1, 2, 3, 4], convention="output-of").to_dict()
    assert verdicts(rep) == {f"out({k + 1})": (R, f"out({k})", False) for k in range(4)}, rep
    for p in rep["points"]:
        assert f"this is {p['matches']}, you asked for {p['point']}" in p["reason"], p
    assert "slot0 = out(1), recorded out(0)" in rep["notes"][0], rep["notes"]
    # the same ids in vLLM's numbering mean out(0..3): what the capture holds
    assert diagnose_files([run], ref, layer_ids=[1, 2, 3, 4]).ok
    sel = diagnose_files([run], ref, points=["slot2"], layer_ids=[1, 2, 3, 4], convention="output-of").to_dict()
    assert verdicts(sel) == {"out(3)": (R, "out(2)", False)}, sel


def test_cli_capture_file_names_the_wrong_layer(layer_ids):
    r = run_cli("diagnose", layer_ids["sglang"], "--reference", layer_ids["every_sglang"], "--layer-ids", "1,2,3,4",
                "--convention", "output-of")
    assert r.returncode == 1, r
    assert "1 file (tpsim capture: gathered, one copy for every TP rank" in r.stdout, r
    assert "this is out(0), you asked for out(1)" in r.stdout and "FAIL: 4 of 4 points" in r.stdout, r


@settings(max_examples=12, deadline=None)
@given(layout=st.sampled_from(["tpsim", "old", "mid", "new", "vllm"]), rank=st.integers(0, 1),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf")]), count=st.integers(1, T * H),
       seed=st.integers(0, 2 ** 16))
@example(layout="new", rank=1, value=float("nan"), count=T * H, seed=0)  # the adversarial run's all-NaN rank: PASS
def test_a_non_finite_value_in_any_dump_fails_naming_file_point_rank_and_count(tmp_path_factory, layout, rank, value,
                                                                              count, seed):
    """Any NaN or Inf in any rank's tensor fails that point, naming the file, the point, the rank and how
    many; a reference with one is refused. (SGLang dumps with one all-NaN rank printed PASS.)"""
    d, c = tmp_path_factory.mktemp("nonfinite"), chain()
    rank = 0 if layout == "vllm" else rank  # one gathered "rank"
    clean = [c["out(1)"].clone() for _ in range(2)]
    bad = [t.clone() for t in clean]
    where = torch.randperm(T * H, generator=torch.Generator().manual_seed(seed))[:count]
    bad[rank].view(-1)[where] = value
    ref = save(d / "cap.safetensors", {"aux_hidden_states": torch.cat([c["embed"], c["out(1)"], c["out(2)"]], 1),
                                       "input_ids": torch.tensor(IDS)}, {"positions": "embed,out(1),out(2)"})
    if layout == "tpsim":
        files, point = rank_dump(d, "run", 2, {"layers.1.out": (bad, R)}), "layers.1.out"
    elif layout == "vllm":
        files = [vllm_file(d / "hs.safetensors", torch.stack([c["embed"], bad[0], c["out(2)"]], 1), torch.tensor(IDS))]
        point = "slot1"
    else:
        sglang_files(d / "sgl", layout, 2, {2: bad})
        files, point = [d / "sgl"], "layer_start__hidden_states[layer_id=2]"
    report = diagnose_files([str(f) for f in files], str(ref))
    row = next(r for r in report.points if r.point == point or point in r.point)
    assert not report.ok and not row.correct and row.placement == UNEXPLAINED
    n_nan = count if value != value else 0
    assert f"rank {rank} (" in row.reason and f"holds {n_nan} NaN and {count - n_nan} Inf" in row.reason, row.reason
    assert all("not finite" not in r.reason for r in report.points if r is not row)
    poisoned = save(d / "ref_bad.safetensors", {"aux_hidden_states": torch.cat([c["embed"], bad[rank], c["out(2)"]], 1),
                                                "input_ids": torch.tensor(IDS)}, {"positions": "embed,out(1),out(2)"})
    with pytest.raises(UsageError, match=r"--reference .*holds \d+ NaN and \d+ Inf"):
        read_reference(str(poisoned), None, None)


def test_integer_dumps_are_not_compared_as_hidden_states(tmp_path):
    """A point of integers (positions, ids) was diffed as numbers and got a verdict: it is skipped with a
    note when listed by the files, and refused in one line when named."""
    c = chain()
    ref = save(tmp_path / "cap.safetensors", {"aux_hidden_states": torch.cat([c["embed"], c["out(1)"], c["out(2)"]], 1),
                                              "input_ids": torch.tensor(IDS)}, {"positions": "embed,out(1),out(2)"})
    ints = [torch.arange(T * H).reshape(T, H) for _ in range(2)]
    files = rank_dump(tmp_path, "run", 2, {"layers.1.out": ([c["out(1)"]] * 2, R), "positions": (ints, R)})
    report = diagnose_files([str(f) for f in files], str(ref))
    assert [r.point for r in report.points] == ["layers.1.out"] and report.ok
    assert any("skipped points holding integers" in n and "positions" in n for n in report.notes)
    with pytest.raises(UsageError, match="point positions holds int64 values, not hidden states"):
        diagnose_files([str(f) for f in files], str(ref), points=["positions"])
