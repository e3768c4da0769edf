"""Issue 55 (reliability IV), the draft side: a bad --prompts file, a --steps or --new-tokens past what the target
allows, and a run past the time or memory bound are refused in one line (exit 2, no traceback, nothing written)
before any rank starts; --ignore-limits goes past the bounds on purpose; an AL is printed only over at least one
verify round. The drawn properties build the typed requests and run them in-process with the rank launcher
replaced by a tripwire; a few CLI runs hold the whole promise end to end (tests/clirun.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tpsim.app.ranks
from clirun import assert_one_line_error, run_cli
from test_acceptance_cli import tiny_draft
from tpsim.app.acceptance import seeded_prompts
from tpsim.app.acceptance_request import AcceptanceRequest, run_acceptance
from tpsim.app.asks import EngineAsk, PromptsAsk
from tpsim.app.bounds import ANNOUNCE_S, MAX_RUN_S, estimate
from tpsim.app.request import MAX_TOKENS, RunRequest
from tpsim.app.triage_request import TriageRequest, run_triage
from tpsim.base.errors import UsageError
from tpsim.draft.acceptance import has_round, rounds
from tpsim.draft.checkpoint import read
from tpsim.profiles.profile import Served
from tpsim.run.spec import ModelSource

SERVER = "sglang@0.5.12"
TINY = ModelSource.load("tiny", [], []).cfg  # the target the tiny draft names
VOCAB, CONTEXT = TINY.vocab_size, TINY.max_position_embeddings
JSON_SHAPE = '{{"sequences": [{{"prompt": {}, "answer": {}}}]}}'


class RankStarted(Exception):
    """The tripwire: a rank would have started."""


def _tripwire(job, world, **kwargs):
    raise RankStarted(f"{job.__name__} on {world} ranks")


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    return tiny_draft(tmp_path_factory.mktemp("d") / "draft", [1, 3, 4])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scratch")


def acceptance(draft: Path, prompts: str | None = None, new_tokens=48, steps=3, ignore_limits: bool = False,
               returned: str | None = None) -> AcceptanceRequest:
    return AcceptanceRequest(SERVER, EngineAsk(Served(server=SERVER)), str(draft), steps=steps,
                             prompts=PromptsAsk(prompts, new_tokens), returned=returned,
                             run=RunRequest(ignore_limits=ignore_limits))


def triage(draft: Path, prompts: str | None = None, new_tokens=48, steps=3) -> TriageRequest:
    return TriageRequest(SERVER, EngineAsk(Served(server=SERVER)), draft=str(draft), measure=True, steps=steps,
                         prompts=PromptsAsk(prompts, new_tokens))


RUN = {AcceptanceRequest: run_acceptance, TriageRequest: run_triage}


def refused(build: Callable, folder: Path) -> str:
    """The request `build` makes, run with a tripwire for ranks: its refusal, one line, raised before any rank
    would start, `folder` left as it was."""
    before = sorted(folder.iterdir())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tpsim.app.ranks, "run_on_ranks", _tripwire)
        with pytest.raises(UsageError) as e:
            req = build()
            RUN[type(req)](req)
    assert sorted(folder.iterdir()) == before
    line = str(e.value)
    assert line and "\n" not in line and "Traceback" not in line
    return line


def reaches_ranks(req, folder: Path) -> str:
    """`req` passes every check: it gets as far as starting a rank. What it said on stderr first."""
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stderr(err):
        m.setattr(tpsim.app.ranks, "run_on_ranks", _tripwire)
        with pytest.raises(RankStarted):
            RUN[type(req)](req)
    return err.getvalue()


# --- bad prompts files -------------------------------------------------------------------------

ok_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
out_of_vocab = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB))  # past int64 included
not_ids = st.one_of(st.floats(), st.booleans(), st.none(), st.text(max_size=4), st.lists(st.integers(0, 9), max_size=2),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))


@st.composite
def bad_lines(draw) -> str:
    """Token-id lines, one id of which is outside the vocabulary or not an ASCII integer."""
    prompts = [list(map(str, p)) for p in draw(st.lists(ok_ids, min_size=1, max_size=4))]
    bad = draw(st.one_of(out_of_vocab.map(str), st.sampled_from(["1.0", "true", "x", "", "1_0", "\u0663", "Infinity",
                                                                 "0x10", "+-1"])))
    line = draw(st.sampled_from(prompts))
    line.insert(draw(st.integers(0, len(line))), bad)
    return "\n".join(", ".join(p) for p in prompts) + "\n"


@st.composite
def bad_json_ids(draw) -> str:
    """tpsim's prompts JSON with one id in a prompt or an answer out of the vocabulary or of the wrong type."""
    prompt, answer = draw(ok_ids), draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=8))
    ids = draw(st.sampled_from([prompt, answer]))
    ids.insert(draw(st.integers(0, len(ids))), draw(st.one_of(out_of_vocab, not_ids)))
    return json.dumps({"sequences": [{"prompt": prompt, "answer": answer}]})


@st.composite
def bad_json_shapes(draw) -> str:
    """tpsim's prompts JSON with no sequences, a sequence that is no object, or a prompt or answer left out, empty or
    no list."""
    which = draw(st.sampled_from(["prompt", "answer", "sequence", "sequences"]))
    value = draw(st.sampled_from(["leave out", [], "1,2", 3, {}, True, None]))
    seq = {"prompt": [1, 2], "answer": [3, 4, 5, 6]}
    if which in seq:
        del seq[which]
        doc = {"sequences": [seq if value == "leave out" else {**seq, which: value}]}
    elif which == "sequence":
        doc = {"sequences": [value]}
    else:
        doc = {} if value == "leave out" else {"sequences": value}
    return json.dumps(doc)


too_long = st.integers(CONTEXT - 47, 2 * CONTEXT)  # with the default 48 new tokens, past the context
bad_prompt_files = st.one_of(
    bad_lines(), bad_json_ids(), bad_json_shapes(),
    st.sampled_from(["", "\n\n", "   \n", "{", '{"sequences": ', "[1, 2]", "1,2\n3,,4\n"]),
    st.sampled_from(["Infinity", "-Infinity", "NaN"]).map(lambda c: JSON_SHAPE.format(f"[1, {c}]", "[1, 2, 3, 4]")),
    st.integers(2, 200_000).map(lambda d: '{"sequences": ' + "[" * d + "]" * d + "}"),
    too_long.map(lambda n: ",".join(["7"] * n) + "\n"),
    too_long.map(lambda n: JSON_SHAPE.format([7] * (n - 4), [7] * 52)),
    st.binary(min_size=1, max_size=8).map(lambda b: b"\xff" + b),  # not UTF-8
)


@settings(max_examples=30, deadline=None)
@given(content=bad_prompt_files, command=st.sampled_from([acceptance, triage]))
@example(content="-1,2,3\n", command=acceptance)  # failed inside a rank: exit 3, IndexError
@example(content=f"{VOCAB - 1},{VOCAB},2\n", command=acceptance)  # an id equal to vocab_size ran and gave an AL
@example(content="1,99999999999999999999999\n", command=acceptance)  # past int64: failed inside a rank
@example(content='{"sequences": []}', command=acceptance)  # no sequences: ran and reported, exit 0
@example(content=JSON_SHAPE.format("[1.0, 2]", "[3, 4, 5, 6]"), command=acceptance)  # float ids: ran, exit 0
@example(content=JSON_SHAPE.format("[true, 2]", "[3, 4, 5, 6]"), command=acceptance)  # boolean ids: ran, exit 0
@example(content='{"sequences": [{"prompt": [1, 2]}]}', command=triage)  # no answers: ran and reported, exit 0
@example(content=JSON_SHAPE.format("[]", "[3, 4, 5, 6]"), command=acceptance)  # empty prompt: a traceback
@example(content=JSON_SHAPE.format("[Infinity]", "[3, 4, 5, 6]"), command=acceptance)  # Infinity: a traceback
@example(content='{"sequences": ' + "[" * 100_000 + "]" * 100_000 + "}", command=acceptance)  # nested: traceback
@example(content=",".join(["7"] * 5000) + "\n", command=acceptance)  # a giant line: out of memory in a rank
@example(content="1,\n" * (8 << 20), command=acceptance)  # over the 16 MiB read
def test_a_bad_prompts_file_is_refused_in_one_line_before_any_rank(draft, scratch, content, command):
    """Guards the promise for --prompts (acceptance and triage --measure): a file with an id outside the target's
    vocabulary or past int64, an id that is no integer, no sequences, a prompt or answer missing or empty, a JSON
    constant, deep nesting, a prompt past the context, binary data or too many bytes is refused by the typed request
    in one line naming --prompts, before a rank starts, writing nothing."""
    path = scratch / "prompts.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    try:
        line = refused(lambda: command(draft, str(path)), scratch)
    finally:
        path.unlink()
    assert "--prompts" in line, line


def test_a_fifo_or_a_directory_is_refused_without_waiting(draft, scratch):
    """Guards: --prompts names something that is not a regular file (a FIFO hung waiting for a writer)."""
    fifo = scratch / "fifo"
    os.mkfifo(fifo)
    try:
        for path in (fifo, scratch):
            assert "not a regular file" in refused(lambda: acceptance(draft, str(path)), scratch)
    finally:
        fifo.unlink()


def test_good_prompts_pass_the_checks(draft, scratch):
    """Guards against refusing too much: ids at both ends of the vocabulary, a prompt filling the context with its
    answer, and tpsim's prompts JSON reach the ranks."""
    path = scratch / "good.txt"
    edge = [0, VOCAB - 1] * ((CONTEXT - 48) // 2)
    for content in (",".join(map(str, edge)) + "\n\n 5 , 6\n", JSON_SHAPE.format([0, VOCAB - 1], [1, 2, 3, 4])):
        path.write_text(content)
        try:
            reaches_ranks(acceptance(draft, str(path)), scratch)
        finally:
            path.unlink()


# --- --steps, --new-tokens and the bounds ---------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(option=st.sampled_from(["steps", "new_tokens"]),
       value=st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_TOKENS + 1), st.booleans(), st.floats(),
                       st.text(max_size=4), st.none()))
@example(option="steps", value=10**9)  # ran until killed
@example(option="new_tokens", value=10**9)  # ran until killed
def test_a_count_out_of_range_is_refused_by_the_typed_request(draft, scratch, option, value):
    """Guards: --steps and --new-tokens are integers from 1 to MAX_TOKENS in the typed requests themselves, not only
    in the CLI's parse."""
    for command in (acceptance, triage):
        line = refused(lambda: command(draft, **{option: value}), scratch)
        assert f"--{option.replace('_', '-')}" in line, line


no_round = st.integers(1, 200).flatmap(lambda new: st.tuples(st.integers(new, 4 * new), st.just(new)))
past_context = st.tuples(st.integers(1, 8), st.integers(CONTEXT - 15, MAX_TOKENS))  # the seeded prompts: 16 tokens


@settings(max_examples=30, deadline=None)
@given(steps_new=st.one_of(no_round, past_context))
@example(steps_new=(1000, 48))  # ran 164 s to "AL nan ± nan (0 rounds)", judged "keeps"
@example(steps_new=(3, 5000))  # ran until killed
def test_steps_and_answers_past_what_the_target_allows_are_refused(draft, scratch, steps_new):
    """Guards: k leaves one verify round in the longest answer (else the AL is over no round), and every prompt with
    its answer fits the target's max_position_embeddings; neither is a limit --ignore-limits lifts."""
    steps, new = steps_new
    line = refused(lambda: acceptance(draft, steps=steps, new_tokens=new, ignore_limits=True), scratch)
    assert ("verify round" in line and f"--steps {steps}" in line) or "max_position_embeddings" in line, line


@settings(max_examples=12, deadline=None)
@given(new=st.integers(4, CONTEXT - 16))  # k = 3 needs 4 answer tokens
@example(new=48)
@example(new=4000)  # ran until killed
def test_the_time_bound_refuses_without_ignore_limits_and_a_long_run_is_announced(draft, scratch, new):
    """Guards the cost bound: a run estimated past MAX_RUN_S is refused naming --ignore-limits, and runs with it;
    one estimated past ANNOUNCE_S prints its estimate on stderr before it starts, one under it prints nothing."""
    cost = estimate(TINY, read(draft).config, seeded_prompts(VOCAB, 8, 16, new, 0), 3, "cpu", "float32")
    if cost.seconds > MAX_RUN_S:
        line = refused(lambda: acceptance(draft, new_tokens=new), scratch)
        assert "--ignore-limits" in line and ("estimated cost:" in line or "at once" in line), line
    said = reaches_ranks(acceptance(draft, new_tokens=new, ignore_limits=cost.seconds > MAX_RUN_S), scratch)
    assert said == (f"tpsim: {cost.line}\n" if cost.seconds > ANNOUNCE_S else ""), said


def test_the_memory_bound_names_ignore_limits(draft, scratch):
    """Guards: k draft steps over a long answer whose attention scores cannot fit the memory free are refused."""
    line = refused(lambda: acceptance(draft, steps=3000, new_tokens=CONTEXT - 16), scratch)
    assert "at once" in line and "--ignore-limits" in line, line


@settings(max_examples=30, deadline=None)
@given(prompt=st.integers(1, 6), answer=st.integers(0, 12), k=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_the_up_front_round_rule_is_the_one_rounds_walks(prompt, answer, k, seed):
    """Guards: the refusal before ranks (has_round) and the measurement (rounds) agree on when a verify round
    exists: an answer the check passes is measured over one round at least, and one it refuses would have none."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (prompt + answer,), generator=g).tolist()
    proposed = torch.randint(0, 4, (prompt + answer - 1, k), generator=g)
    assert has_round(answer, k) == (rounds(proposed, tokens, prompt).rounds > 0)


# --- the CLI, end to end --------------------------------------------------------------------------

def test_the_cli_refuses_the_reproducers_in_one_line(draft, tmp_path):
    """Guards the whole promise from the command line for reproducers that failed in a rank, hung or ran until
    killed: one stderr line, exit 2, no traceback, no rank started, nothing written (--returned-hidden-states
    included)."""
    fifo, negative = tmp_path / "fifo", tmp_path / "negative.txt"
    os.mkfifo(fifo)
    negative.write_text("-1,2,3\n")
    out = tmp_path / "out.safetensors"
    base = ("acceptance", "--draft", draft, "--server", "sglang@0.5.13", "--returned-hidden-states", out)
    for extra, words in [(("--prompts", fifo), ["not a regular file"]),
                         (("--prompts", negative), ["token id -1", "vocab_size 1000"]),
                         (("--new-tokens", "5000"), ["max_position_embeddings 4096", "--new-tokens"]),
                         (("--steps", "1000000000"), ["--steps 1000000000"]),
                         (("--steps", "1000"), ["--steps 1000", "verify round"])]:
        assert_one_line_error(run_cli(*base, *extra, timeout_s=120), words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "negative.txt"]
    r = run_cli("triage", "--draft", draft, "--server", SERVER, "--measure", "--prompts", negative, timeout_s=120)
    assert_one_line_error(r, ["--prompts", "token id -1"])


def test_no_verify_round_left_is_no_verdict(draft, tmp_path):
    """Guards item 3: answers tpsim's target leaves before one round (given elsewhere, disagreeing at once) give no
    AL and no "keeps": exit 1, the verdict one line saying why."""
    path = tmp_path / "disagrees.json"
    path.write_text(JSON_SHAPE.format([1, 2, 3, 4, 5], [7] * 6))
    r = run_cli("acceptance", "--draft", draft, "--server", SERVER, "--prompts", path, "--summary")
    assert r.returncode == 1, r
    assert r.stdout.startswith("tpsim acceptance: no verdict: no verify round") and r.stdout.count("\n") == 1, r
    assert "nan" not in r.stdout and "keeps" not in r.stdout, r


def test_the_help_states_the_time_bound():
    """Guards the help against drifting from the bound the code enforces."""
    from tpsim.cli.main import build_parser
    sub = build_parser()._subparsers._group_actions[0].choices["acceptance"]
    text = next(a.help for a in sub._actions if a.dest == "ignore_limits")
    assert f"past {MAX_RUN_S // 60} minutes" in text, text
