"""The draft under TP on real gloo ranks (tpsim.app.draft_tp, tpsim.run.draft_tp_jobs): the vocabulary split refused
exactly where vLLM's released assert refuses it and, where accepted, sharded logits equal to the unsharded draft's;
each rank's embed_tokens verdict on its own shard; SGLang's greedy verify with and without the TP broadcast. The
quotes are checked against the released code on disk (SGLang's unpacked wheels, vLLM 0.32.0's in .venv-engine)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st

from clirun import assert_one_line_error, run_cli
from sglang_src import body, no_sources, released_function
from tpsim.app import draft_tp
from tpsim.parallel.pool import RankPool
from tpsim.profiles import draft_tp as cited
from tpsim.profiles.profile import Platform
from tpsim.profiles.registry import version_key
from tpsim.run import draft_tp_jobs as jobs

VLLM = Path(__file__).resolve().parents[1] / ".venv-engine/lib/python3.11/site-packages/vllm"
SGLANG_READ = [f"0.5.{i}" for i in range(6, 24)]
TPS = (2, 3, 4)


@pytest.fixture(scope="module")
def pools():
    made = {tp: RankPool(tp, timeout_s=60) for tp in TPS}
    yield made
    for p in made.values():
        p.close()


def _vllm_released(path: str, *names: str, **scope) -> dict:
    """The top-level functions `names` of vLLM 0.32.0's `path`, compiled alone from the wheel's text with `scope`
    as their globals."""
    f = VLLM / path
    if not f.exists():
        pytest.skip(f"no vLLM 0.32.0 wheel at {VLLM} (make engine)")
    tree = ast.parse(f.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    namespace: dict = dict(scope)
    exec(compile(ast.Module(nodes, []), str(f), "exec"), namespace)  # noqa: S102 - released code, drawn inputs
    return namespace


# --- 1. the vocabulary split -------------------------------------------------------------------------------------

@settings(max_examples=60)
@given(vocab=st.integers(1, 200_000), tp=st.integers(1, 16))
@example(vocab=4096, tp=3)
def test_vllm_refuses_exactly_where_its_released_assert_does(vocab, tp):
    utils = _vllm_released("distributed/utils.py", "ensure_divisibility", "divide")
    pad = _vllm_released("model_executor/layers/vocab_parallel_embedding.py", "pad_vocab_size",
                         DEFAULT_VOCAB_PADDING_SIZE=cited.PAD)["pad_vocab_size"]
    try:
        utils["divide"](pad(vocab, cited.PAD), tp)
        released = None
    except AssertionError as e:
        released = f"AssertionError: {e}"
    assert cited.vocab_split("vllm", False, False).refusal(vocab, tp) == released


@settings(max_examples=60)
@given(vocab=st.integers(1, 200_000), tp=st.integers(1, 16), everywhere=st.booleans(), cpu=st.booleans())
@example(vocab=4096, tp=3, everywhere=False, cpu=False)
def test_sglang_refuses_off_cpu_before_0_5_22_as_its_released_assert_does(vocab, tp, everywhere, cpu):
    split = cited.vocab_split("sglang", everywhere, cpu)
    rows = split.rows(vocab, tp)
    if everywhere or cpu:
        assert rows >= vocab and rows % tp == 0 and rows % cited.PAD == 0 and split.refusal(vocab, tp) is None
        assert rows - vocab < cited.PAD * tp
        return
    divide = released_function("0.5.17", "python/sglang/srt/distributed/utils.py", "divide",
                               ensure_divisibility=released_function("0.5.17", "python/sglang/srt/distributed/utils.py",
                                                                     "ensure_divisibility"))
    try:
        divide(rows, tp)
        released = None
    except AssertionError as e:
        released = f"AssertionError: {e}"
    assert split.refusal(vocab, tp) == released


@settings(max_examples=25)
@given(vocab=st.integers(1, 700), hidden=st.integers(1, 24), tp=st.sampled_from(TPS), engine=st.sampled_from(
    ["vllm", "sglang"]), everywhere=st.booleans(), seed=st.integers(0, 2**16))
@example(vocab=4096, hidden=8, tp=3, engine="sglang", everywhere=True, seed=0)
@example(vocab=65, hidden=4, tp=4, engine="vllm", everywhere=False, seed=1)  # the last rank: padding rows only
def test_where_accepted_the_sharded_logits_equal_the_unsharded(pools, vocab, hidden, tp, engine, everywhere, seed):
    split = cited.vocab_split(engine, everywhere, False)
    refused, same = draft_tp.vocab_replay(pools[tp], vocab, hidden, split, seed)
    assert (refused is None) == (split.rows(vocab, tp) % tp == 0)
    assert same


def test_a_wrong_shard_is_seen(pools):
    """The negative control: logits gathered from shards a rank off differ from the unsharded draft's."""
    w, x = torch.randn(128, 8), torch.randn(3, 8)
    every = pools[2].run(jobs.sharded_head, tp=2, weight=w.roll(64, 0), rows=128, hidden=x)
    assert not torch.allclose(every[0], F.linear(x, w))


# --- 2. the embed_tokens verdict per rank ------------------------------------------------------------------------

@settings(max_examples=20)
@given(vocab=st.integers(2, 300), hidden=st.integers(1, 8), tp=st.sampled_from(TPS), data=st.data())
def test_each_rank_judges_its_own_shard_and_the_lookup_is_the_drafts(pools, vocab, hidden, tp, data):
    target = torch.randn(vocab, hidden)
    changed = data.draw(st.sets(st.integers(0, vocab - 1), max_size=3))
    draft = target.clone()
    for r in changed:
        draft[r] += 1.0
    per = -(-vocab // 64) * 64 // tp
    got = draft_tp.verdicts(pools[tp], target, draft, unanimous=False)
    assert [g["verdict"] for g in got] == [not any(r * per <= c < (r + 1) * per for c in changed) for r in range(tp)]
    for g in got:  # an equal shard is the target's own: either module looks up the draft's rows
        assert torch.equal(g["embeds"], draft)
    fixed = draft_tp.verdicts(pools[tp], target, draft, unanimous=True)
    assert len({g["shares"] for g in fixed}) == 1 and fixed[0]["shares"] == (not changed)


# --- 3. SGLang's greedy verify -------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", (3, 4))
def test_without_the_broadcast_ranks_accept_different_counts(pools, tp):
    got = draft_tp.verify_replay(pools[tp], broadcast=False)
    counts = got[0]["counts"]
    assert len(set(counts)) > 1 and [g["count"] for g in got] == counts


@settings(max_examples=10)
@given(tp=st.sampled_from((3, 4)), seed=st.integers(0, 1000))
def test_with_the_broadcast_the_counts_agree(pools, tp, seed):
    got = draft_tp.verify_replay(pools[tp], broadcast=True, seed=seed)
    assert len(set(got[0]["counts"])) == 1 and all(g["predict"] == got[0]["predict"] for g in got)


def test_two_partials_add_the_same_in_either_order():
    """Why TP 2 is read, not replayed: a + b == b + a bit for bit."""
    parts = torch.randn(2, 5, 7).to(torch.bfloat16)
    assert torch.equal(jobs.rank_order_sum(parts, 0), jobs.rank_order_sum(parts, 1))


@pytest.mark.parametrize("release", SGLANG_READ[SGLANG_READ.index(cited.OLDEST_VERIFY):])
def test_every_verify_quote_holds_in_its_interval(release):
    branch = draft_tp.verify_branch(release)
    text = body(release, cited.EAGLE_UTILS, "eagle_sample")
    if text is None:
        no_sources(f"no unpacked sglang {release} wheel")
    assert " ".join(branch.source.quote.split()) in text, (release, branch.since)
    for p in Platform:  # each platform named in the condition is in the table, and no other
        named = f"_is_{p.value}" in text.split("target_predict = torch.argmax")[0].rsplit("if ", 1)[-1] or \
            f"is_{p.value}=_is_{p.value}" in text
        assert named == (p in branch.greedy), (release, p)


def test_before_the_oldest_read_verify_is_unverified():
    assert draft_tp.verify_branch("0.5.13") is None and draft_tp.verify_branch("latest").since == "0.5.21"


@pytest.mark.parametrize("release", SGLANG_READ)
def test_sglang_pads_by_tp_on_cpu_then_everywhere(release):
    later = version_key(release) >= version_key(cited.SGLANG_PADS_EVERYWHERE)
    source = cited.SGLANG_SPLIT if later else cited.SGLANG_SPLIT_CPU
    text = body(release, source.path, source.symbol)
    if text is None:
        no_sources(f"no unpacked sglang {release} wheel")
    assert " ".join(source.quote.split()) in text and ("_is_cpu and pad_vocab_size" in text) != later
    divide = body(release, cited.SGLANG_DIVIDE.path, cited.SGLANG_DIVIDE.symbol)
    assert " ".join(cited.SGLANG_DIVIDE.quote.split()) in divide


def test_no_eagle_proposer_reads_the_draft_tp():
    """vllm issue #31345 as read: the EAGLE proposer's files never name draft_parallel_config."""
    if not VLLM.exists():
        pytest.skip(f"no vLLM 0.32.0 wheel at {VLLM} (make engine)")
    for name in ("llm_base_proposer.py", "eagle.py"):
        assert "draft_parallel_config" not in (VLLM / "v1/spec_decode" / name).read_text()


@pytest.mark.parametrize("source", [cited.VLLM_DIVIDE, cited.VLLM_SPLIT, cited.VLLM_VERDICT, cited.VLLM_SHARE,
                                    cited.VLLM_DRAFT_TP],
                         ids=lambda s: s.symbol)
def test_every_vllm_quote_is_in_the_wheel(source):
    f = VLLM / source.path.removeprefix("vllm/")
    if not f.exists():
        pytest.skip(f"no vLLM 0.32.0 wheel at {VLLM} (make engine)")
    assert " ".join(source.quote.split()) in " ".join(f.read_text().split()), source


# --- the command line --------------------------------------------------------------------------------------------

def test_platform_without_an_sglang_server_is_one_line():
    r = run_cli("draft", "smollm2-135m-eagle3", "--server", "vllm@0.32.0", "--tp", "3", "--platform", "cpu")
    assert_one_line_error(r, ["--platform cpu", "--server sglang@0.5.17"])


def test_platform_at_tp_1_is_one_line():
    r = run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.17", "--platform", "cpu")
    assert_one_line_error(r, ["--platform cpu", "--tp 2"])


def test_an_unknown_platform_is_one_line():
    assert_one_line_error(run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.17", "--platform", "tpu"),
                          ["--platform"])


def test_hip_from_0_5_18_broadcasts_and_is_clean():
    r = run_cli("draft", "smollm2-135m-eagle3", "--server", "sglang@0.5.18", "--tp", "4", "--platform", "hip")
    assert "verify-no-broadcast" not in r.stdout and r.returncode == 0, r
    assert version_key("0.5.18") >= version_key(next(b.since for b in cited.VERIFY_BRANCHES if b.broadcast))
