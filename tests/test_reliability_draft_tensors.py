"""Issue 55 (reliability IV), a draft's tensors and files. A draft that loads but is wrong (a NaN or Inf weight, a
weight of the wrong dtype, d2t offsets that leave the vocab, a missing tensor, two shards holding one tensor with
different values) is a finding in `tpsim draft` naming the tensor, and acceptance and `triage --measure` refuse it in
one line before any rank starts: never an AL printed for a broken draft. A weights file tpsim cannot read as a draft
(a `.bin` of odd keys, no data or a pickle; a `.safetensors` file given for the directory) is one line, exit 2."""

from __future__ import annotations

import json
import math
import os
import pickle
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from safetensors.torch import save_file

from clirun import assert_one_line_error, run_cli
from test_acceptance_cli import DRAFT
from test_draft_checkpoint import CONFIG, clean_tensors
from tpsim.app.acceptance_request import AcceptanceRequest, run_acceptance
from tpsim.app.asks import EngineAsk
from tpsim.app.draft_request import DraftRequest, run_draft
from tpsim.app.triage_request import TriageRequest, run_triage
from tpsim.base.errors import UsageError
from tpsim.draft.checkpoint import inspect, runnable
from tpsim.draft.config import DraftConfig
from tpsim.draft.findings import DraftDefect
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.weights import specs
from tpsim.profiles.profile import Served

CFG = DraftConfig.from_json(CONFIG)
SHAPES = {name: s.shape for name, s in specs(Eagle3Draft(CFG)).items()}
WEIGHTS = sorted(SHAPES)
REQUIRED = sorted(set(SHAPES) - {"embed_tokens.weight"}) + ["d2t"]  # embed_tokens may come from the target
SHARDS = ("model-00001.safetensors", "model-00002.safetensors")
DEFECT = {"nonfinite": DraftDefect.NON_FINITE, "every-nonfinite": DraftDefect.NON_FINITE, "dtype": DraftDefect.DTYPE,
          "d2t": DraftDefect.VOCAB_MAP, "missing": DraftDefect.MISSING_KEY, "conflict": DraftDefect.CONFLICT}
NAN, INF = float("nan"), float("inf")


class Plant(NamedTuple):
    """One corruption of a clean draft: `kind` (a DEFECT key), the tensor, a flat index into it, and the value
    (a float, a dtype's name, or for d2t the target id the draft id at `index` lands on)."""

    kind: str
    key: str
    index: int = 0
    value: object = None


@st.composite
def plants(draw) -> Plant:
    kind = draw(st.sampled_from(sorted(DEFECT)))
    if kind == "missing":
        return Plant(kind, draw(st.sampled_from(REQUIRED)))
    if kind == "d2t":
        target = draw(st.one_of(st.integers(-10**6, -1), st.integers(CFG.vocab_size, 10**6)))
        return Plant(kind, "d2t", draw(st.integers(0, CFG.draft_vocab_size - 1)), target)
    if kind == "every-nonfinite":
        return Plant(kind, WEIGHTS[0], 0, draw(st.sampled_from([NAN, INF, -INF])))
    key = draw(st.sampled_from(WEIGHTS + (["d2t"] if kind == "dtype" else [])))
    if kind == "dtype":
        return Plant(kind, key, 0, "float32" if key == "d2t" else draw(st.sampled_from(["bool", "int32", "int64"])))
    index = draw(st.integers(0, math.prod(SHAPES[key]) - 1))
    return Plant(kind, key, index, draw(st.sampled_from([NAN, INF, -INF])) if kind == "nonfinite" else None)


def planted(tensors: dict[str, torch.Tensor], p: Plant) -> dict[str, dict[str, torch.Tensor]]:
    """The draft's weight files (name -> tensors) once `p` is planted in `tensors`."""
    t = {k: v.clone() for k, v in tensors.items()}
    if p.kind == "nonfinite":
        t[p.key].view(-1)[p.index] = p.value
    elif p.kind == "every-nonfinite":
        t.update({k: torch.full_like(v, p.value) for k, v in t.items() if v.is_floating_point()})
    elif p.kind == "dtype":
        t[p.key] = t[p.key] > 0 if p.value == "bool" else t[p.key].float() if p.key == "d2t" else \
            (t[p.key] * 100).to(getattr(torch, p.value))
    elif p.kind == "d2t":
        t["d2t"][p.index] = p.value - p.index
    elif p.kind == "missing":
        del t[p.key]
    else:  # a second shard holding the tensor again, one value changed
        other = t[p.key].clone()
        other.view(-1)[p.index] += 1
        return {SHARDS[0]: t, SHARDS[1]: {p.key: other}}
    return {SHARDS[0]: t}


def write_draft(folder: Path, config: dict, files: dict[str, dict[str, torch.Tensor]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))
    return folder


def said(p: Plant) -> list[str]:
    """What the finding's cause must say beyond the tensor's name: where the planted value is."""
    if p.kind == "nonfinite":
        first = [int(i) for i in torch.unravel_index(torch.tensor(p.index), SHAPES[p.key])]
        return [f"(the first at {first})"]
    if p.kind == "d2t":
        return [f"the first draft id {p.index} to {p.value}"]
    return list(SHARDS) if p.kind == "conflict" else []


def refusal(run) -> str:
    with pytest.raises(UsageError) as e:
        run()
    return str(e.value)


def acceptance(folder: Path):
    return lambda: run_acceptance(AcceptanceRequest("sglang", EngineAsk(Served(server="sglang")), str(folder)))


def triage_measure(folder: Path):
    return lambda: run_triage(TriageRequest("sglang", EngineAsk(Served(server="sglang")), draft=str(folder),
                                            measure=True))


@settings(max_examples=30, deadline=None)
@given(plant=plants(), seed=st.integers(0, 3))
@example(plant=Plant("nonfinite", "fc.weight", 0, NAN), seed=0)  # issue 55: acceptance printed an AL, exit 0
@example(plant=Plant("nonfinite", "lm_head.weight", 7, INF), seed=0)
@example(plant=Plant("every-nonfinite", WEIGHTS[0], 0, NAN), seed=0)
@example(plant=Plant("d2t", "d2t", 11, 10_000), seed=0)  # an offset past the vocab
@example(plant=Plant("d2t", "d2t", 3, -2), seed=0)  # a negative offset that leaves the vocab
@example(plant=Plant("d2t", "d2t", 0, CONFIG["vocab_size"]), seed=0)  # landing on vocab_size, the first id past it
@example(plant=Plant("missing", "norm.weight"), seed=0)
@example(plant=Plant("dtype", "lm_head.weight", 0, "bool"), seed=0)
@example(plant=Plant("conflict", "fc.weight", 5), seed=0)  # the later shard silently won
def test_a_planted_defect_is_a_finding_naming_the_tensor_and_acceptance_refuses_it(plant, seed):
    """Any one corruption of a clean draft is a `tpsim draft` finding of its kind naming the tensor (and where:
    the first non-finite index, the draft id d2t sends outside the vocab, both shards), and acceptance and
    `triage --measure` refuse the draft with one UsageError naming the tensor, before anything runs."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_draft(Path(tmp) / "d", CONFIG, planted(clean_tensors(CFG, seed), plant))
        findings = run_draft(DraftRequest(str(folder))).findings  # what `tpsim draft DIR` prints
        found = [f for f in findings if (f.defect, f.key) == (DEFECT[plant.kind], plant.key)]
        assert found, findings
        assert all(s in found[0].cause for s in said(plant)), (found[0].cause, said(plant))
        if plant.kind == "every-nonfinite":
            assert {f.key for f in findings if f.defect is DraftDefect.NON_FINITE} == set(WEIGHTS)
        for run in (acceptance(folder), triage_measure(folder)):
            line = refusal(run)
            assert "\n" not in line and "cannot be run as it stands" in line and plant.key in line, line
            assert all(s in line for s in (SHARDS if plant.kind == "conflict" else ())), line


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_a_clean_draft_is_not_refused(seed):
    """The refusal is no false alarm: a clean draft of any seed has no finding and reads as runnable, in one file
    or split over two shards (each tensor once, or held twice with the same bits)."""
    tensors = clean_tensors(CFG, seed)
    half = dict(list(tensors.items())[: len(tensors) // 2])
    with tempfile.TemporaryDirectory() as tmp:
        for i, files in enumerate(({SHARDS[0]: tensors}, {SHARDS[0]: tensors, SHARDS[1]: half})):
            folder = write_draft(Path(tmp) / str(i), CONFIG, files)
            assert inspect(folder) == [] and runnable(folder, "").tensors.keys() == tensors.keys()


def test_a_t2d_defect_is_a_finding_but_not_a_refusal(tmp_path):
    """t2d is read by no engine's draft loader (SGLang and vLLM skip it) nor by tpsim's draft, which maps ids
    through d2t alone: a t2d that disagrees with d2t is a finding, and acceptance still measures the draft."""
    t = clean_tensors(CFG)
    t["t2d"] = torch.ones_like(t["t2d"])
    folder = write_draft(tmp_path / "d", CONFIG, {SHARDS[0]: t})
    assert [(f.defect, f.key) for f in inspect(folder)] == [(DraftDefect.VOCAB_MAP, "t2d")]
    assert runnable(folder, "").tensors.keys() == t.keys()


# --- the command line: one line, exit 2, nothing written; `tpsim draft` exit 1 naming the tensor ------------------

def tiny(change) -> dict[str, dict[str, torch.Tensor]]:
    """The acceptance tests' draft (it runs on the tiny built-in: a missed refusal would print an AL), changed."""
    t = clean_tensors(DraftConfig.from_json(DRAFT), seed=3)
    return change(t) or {SHARDS[0]: t}


def nan_at(key, value=NAN):
    return lambda t: t[key].view(-1).__setitem__(0, value)


def d2t_to(target):
    return lambda t: t["d2t"].__setitem__(0, target)


def every_nan(t):
    t.update({k: torch.full_like(v, NAN) for k, v in t.items() if v.is_floating_point()})


def no_norm(t):
    del t["norm.weight"]


def two_shards(t):
    return {SHARDS[0]: t, SHARDS[1]: {"fc.weight": t["fc.weight"] * 2}}


REPRODUCED = {  # issue 55's reproducers on main: acceptance printed an AL, `tpsim draft` found nothing
    "fc-nan": (nan_at("fc.weight"), "non-finite", "fc.weight"),
    "lm-head-inf": (nan_at("lm_head.weight", INF), "non-finite", "lm_head.weight"),
    "every-weight-nan": (every_nan, "non-finite", "embed_tokens.weight"),  # the first of every weight named
    "d2t-out-of-range": (d2t_to(50_000), "vocab-map", "d2t"),
    "d2t-negative": (d2t_to(-5), "vocab-map", "d2t"),
    "d2t-on-vocab-size": (d2t_to(1000), "vocab-map", "d2t"),
    "norm-missing": (no_norm, "missing-key", "norm.weight"),
    "lm-head-bool": (lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"] > 0), "dtype", "lm_head.weight"),
    "shards-disagree": (two_shards, "conflicting-shards", "fc.weight"),
}


@pytest.mark.parametrize("case", sorted(REPRODUCED))
def test_the_reproducers_are_findings_and_one_line_refusals(tmp_path, case):
    """Each reproducer of issue 55: `tpsim draft --json` exits 1 with the finding on that tensor; acceptance exits 2
    with one line naming it, writing nothing (--returned-hidden-states stays absent)."""
    change, defect, key = REPRODUCED[case]
    folder = write_draft(tmp_path / "d", DRAFT, tiny(change))
    r = run_cli("draft", folder, "--json")
    assert r.returncode == 1 and (defect, key) in {(f["defect"], f["key"]) for f in json.loads(r.stdout)["findings"]}, r
    out = tmp_path / "returned"
    r = run_cli("acceptance", "--draft", folder, "--server", "sglang", "--returned-hidden-states", out)
    assert_one_line_error(r, [f"{defect} ({key})", "cannot be run as it stands", f"tpsim draft {folder}"])
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_triage_measure_refuses_in_one_line_and_triage_reports(tmp_path):
    """`triage --measure` refuses a draft with a NaN lm_head in one line; triage without --measure, which runs no
    draft, lists it among the checkpoint's findings."""
    folder = write_draft(tmp_path / "d", DRAFT, tiny(nan_at("lm_head.weight")))
    assert_one_line_error(run_cli("triage", "--draft", folder, "--server", "sglang", "--measure"),
                          ["non-finite (lm_head.weight)"])
    r = run_cli("triage", "--draft", folder, "--server", "sglang")
    assert r.returncode == 1 and "non-finite (lm_head.weight)" in r.stdout, r


def test_a_d2t_landing_on_vocab_size_is_refused_not_run(tmp_path):
    """The d2t bound at vocab_size (issue 55: `> vocab_size` where `>=` is meant). With `>`, a d2t sending a draft id
    to exactly vocab_size passes the range check, and the t2d check then indexes t2d past its end: an IndexError, not
    a finding. And acceptance, which checked no d2t, ran such a draft: the id reached the draft's embedding, padded to
    a multiple of 64, read a zero padding row, and an AL was printed (an id past the padding crashed in a rank).
    It is a vocab-map finding at exactly vocab_size and not one below, and acceptance refuses it in one line."""
    last = CFG.draft_vocab_size - 1  # the highest draft id maps to the highest target id d2t uses
    for target, bad in ((CFG.vocab_size - 1, False), (CFG.vocab_size, True)):
        t = clean_tensors(CFG)
        t["d2t"][last] = target - last
        found = inspect(write_draft(tmp_path / str(target), CONFIG, {SHARDS[0]: t}))
        assert ((DraftDefect.VOCAB_MAP, "d2t") in [(f.defect, f.key) for f in found]) == bad, found
    folder = write_draft(tmp_path / "edge", DRAFT, tiny(proposes_id_0_as_1000))
    assert_one_line_error(run_cli("acceptance", "--draft", folder, "--server", "sglang", "--model", "tiny"),
                          ["vocab-map (d2t)", "the first draft id 0 to 1000"])


def proposes_id_0_as_1000(t):
    t["norm.weight"].zero_()  # every logit 0: argmax proposes draft id 0
    t["d2t"][0] = 1000


class Reduce:
    """A pickle that runs a command when loaded without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def bin_draft(folder: Path, content) -> Path:
    """A draft in the EAGLE repository's layout: config.json and pytorch_model.bin (`content`: bytes, else saved)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(DRAFT))
    if isinstance(content, bytes):
        (folder / "pytorch_model.bin").write_bytes(content)
    else:
        torch.save(content, folder / "pytorch_model.bin")
    return folder


def bins(marker: Path) -> dict:
    t = clean_tensors(DraftConfig.from_json(DRAFT), seed=3)
    return {"int-key": ({**t, 3: torch.zeros(2)}, "its key 3 (int)"),
            "tuple-key": ({**t, ("a", 1): torch.zeros(2)}, "its key ('a', 1) (tuple)"),
            "empty": (b"", "is empty (0 bytes)"),
            "plain-pickle": (pickle.dumps({"fc.weight": [1.0, 2.0]}), "nothing in it was run"),
            "malicious-reduce": (pickle.dumps(Reduce(marker)), "nothing in it was run"),
            "sparse": ({**t, "fc.weight": t["fc.weight"].to_sparse()}, "fc.weight is sparse"),
            "meta": ({**t, "fc.weight": torch.empty(t["fc.weight"].shape, device="meta")}, "fc.weight is on the meta")}


@pytest.mark.parametrize("case", ["int-key", "tuple-key", "empty", "plain-pickle", "malicious-reduce", "sparse", "meta"])
def test_a_bin_tpsim_cannot_read_is_one_line(tmp_path, case):
    """A pytorch_model.bin whose state dict has int or tuple keys, no bytes, plain pickle, a reduce that runs a
    command, or a sparse or meta tensor: one line, exit 2, from `tpsim draft` and acceptance (int and tuple keys and
    an empty file were tracebacks; the pickles' refusal came with torch's two-line warning; sparse and meta tensors
    were accepted), and the reduce never runs."""
    marker = tmp_path / "ran"
    content, words = bins(marker)[case]
    folder = bin_draft(tmp_path / "eagle", content)
    assert_one_line_error(run_cli("draft", folder), ["pytorch_model.bin", words])
    assert_one_line_error(run_cli("acceptance", "--draft", folder, "--server", "sglang"), ["pytorch_model.bin", words])
    assert not marker.exists()


def test_a_bin_with_nan_is_refused(tmp_path):
    """A pytorch_model.bin with a NaN weight reads (it is a state dict of tensors) and is the same finding and
    refusal as a safetensors draft's (it was accepted)."""
    t = clean_tensors(DraftConfig.from_json(DRAFT), seed=3)
    t["midlayer.mlp.down_proj.weight"][1, 2] = NAN
    folder = bin_draft(tmp_path / "eagle", t)
    r = run_cli("draft", folder, "--summary")
    assert r.returncode == 1 and "non-finite (midlayer.mlp.down_proj.weight)" in r.stdout, r
    assert_one_line_error(run_cli("acceptance", "--draft", folder, "--server", "sglang"),
                          ["non-finite (midlayer.mlp.down_proj.weight)", "(the first at [1, 2])"])


@pytest.mark.parametrize("command", [["draft"], ["acceptance", "--server", "sglang", "--draft"]])
def test_a_safetensors_file_given_for_the_draft_is_refused_with_its_directory(tmp_path, command):
    """A draft path that is a .safetensors file (not the directory, not config.json) is one line naming the
    directory to give instead."""
    folder = write_draft(tmp_path / "d", DRAFT, tiny(lambda t: None))
    line = assert_one_line_error(run_cli(*command, folder / SHARDS[0]), ["is a weights file", f"({folder})"])
    assert "directory" in line
