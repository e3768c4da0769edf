"""`tpsim acceptance` over several served configurations in one run (--sweep FILE, repeated --server): each row is
what that configuration's own run measures, the shared forward gives each spec exactly its own capture, and a bad
configuration is one line, exit 2, before any rank starts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tpsim.app.ranks
from clirun import assert_one_line_error, run_cli
from test_acceptance_cli import tiny_draft
from tpsim.capture import Position, PositionKind
from tpsim.cli.main import run_command
from tpsim.modes import Strategy
from tpsim.parallel.pool import RankPool
from tpsim.run.acceptance import captures_job, captures_many_job
from tpsim.run.spec import ModelSource, RunSpec

TINY = ModelSource.load("tiny", [], [1, 2])


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return tiny_draft(tmp_path_factory.mktemp("d") / "draft", [1, 3, 4])


CONFIGURATIONS = ["--server sglang@0.5.12 --tp 2",
                  "--server vllm@0.32.0 --draft-ids 1,2,3",  # vLLM captures layer i's input: out(0), out(1), out(2)
                  "--server sglang@0.5.12 --tp 2 --enable-flashinfer-allreduce-fusion",
                  "--server sglang@0.5.11 --draft-ids -1,3,4"]  # an embedding id 0.5.11 crashes on: never fed


def test_each_row_of_a_sweep_is_that_configurations_own_run(draft, tmp_path):
    """The property a sweep rests on: sharing the answers, the trained side, the pools and the forwards changes
    nothing. Every configuration's served acceptance, per position and paired difference equal those of
    `tpsim acceptance` run on that configuration alone."""
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# four served configurations\n" + "\n".join(CONFIGURATIONS) + "\n\n")
    common = ["--draft", str(draft), "--new-tokens", "16", "--json"]
    r = run_cli("acceptance", *common, "--sweep", str(sweep))
    assert r.returncode == 1, r  # the 0.5.11 crash is never fed
    out = json.loads(r.stdout)
    assert [c["line"] for c in out["configurations"]] == CONFIGURATIONS
    for line, row in zip(CONFIGURATIONS, out["configurations"]):
        alone = run_cli("acceptance", *common, *line.split())
        one = json.loads(alone.stdout)
        assert row["served"] == one["served"], line
        assert row["kept"] == one["kept"] and out["trained"] == one["trained"], line
        assert (row["paired"] is None) == (one["paired"] is None), line
        if row["paired"] is not None:
            assert row["paired"]["difference"] == one["paired"]["difference"], line
            assert row["paired"]["stderr"] == one["paired"]["stderr"], line
    served = [c["served"] for c in out["configurations"]]
    assert served[1]["positions"] == ["out(0)", "out(1)", "out(2)"]
    assert served[3]["failure"] and served[3]["acceptance_length"] is None
    assert out["timing"]["total_s"] > 0


positions = st.lists(st.sampled_from([Position(PositionKind.OUT, i) for i in range(5)]), min_size=1, max_size=4,
                     unique=True)


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, "gloo", "cpu", 60.0) as p:
        yield p


@settings(max_examples=4, deadline=None)
@given(specs=st.lists(positions, min_size=1, max_size=3),
       strategy=st.sampled_from([Strategy.MODEL_LEVEL, Strategy.IN_LAYER]), tp=st.sampled_from([1, 2]))
@example(specs=[[Position(PositionKind.OUT, 1)], [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, 0)]],
         strategy=Strategy.MODEL_LEVEL, tp=2)
def test_one_forward_for_several_specs_gives_each_its_own_capture(pool, specs, strategy, tp):
    """Specs that differ only in their positions share one forward over the union of their positions; each
    spec's capture (its positions in its own order) is bitwise the one its own forward gives."""
    seqs = [[5, 9, 2, 7, 1, 3], [4, 4, 8]]
    made = [RunSpec(TINY, 0, "float32", (1,), tuple(p), strategy=strategy) for p in specs]
    together = pool.run(captures_many_job, spec=made[0], tp=tp, sequences=seqs, specs=made)[0]
    for spec, got in zip(made, together):
        alone = pool.run(captures_job, spec=spec, tp=tp, sequences=seqs)[0]
        for a, b in zip(got, alone):
            assert torch.equal(a.capture, b.capture) and a.argmax == b.argmax and a.identical == b.identical


class RankStarted(Exception):
    pass


def _tripwire(job, world, **kwargs):
    raise RankStarted(f"{job.__name__} on {world} ranks")


@pytest.mark.parametrize("lines,extra,words", [
    (["--server sglang@0.5.12", "--server vllm --tp 3"], [], "line 2"),  # tiny: 4 heads
    (["--server sglang@0.5.12 --model tiny"], [], "unrecognized arguments: --model"),
    (["--server sglang@0.5.12 --tp two"], [], "--tp"),
    (["--server nosuch@1.0"], [], "line 1"),
    (["--server vllm --draft-ids 1,x,3"], [], "--draft-ids"),
    (["# only a comment", ""], [], "holds no configuration"),
    (["--server sglang@0.5.12 'unclosed"], [], "line 1"),
    (["--server sglang@0.5.12"], ["--server", "vllm", "--server", "sglang"], "repeated --server"),
    (["--server sglang@0.5.12"], ["--returned-hidden-states", "x.safetensors"], "without --sweep"),
])
def test_a_bad_configuration_is_one_line_before_any_rank(draft, tmp_path, capsys, lines, extra, words):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("\n".join(lines) + "\n")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tpsim.app.ranks, "run_on_ranks", _tripwire)
        code = run_command(["acceptance", "--draft", str(draft), "--sweep", str(sweep), *extra], None)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["sweep.txt"]


def test_a_fifo_as_the_sweep_file_is_refused_not_waited_on(draft, tmp_path):
    fifo = tmp_path / "sweep"
    os.mkfifo(fifo)
    assert_one_line_error(run_cli("acceptance", "--draft", str(draft), "--sweep", str(fifo)), "not a regular file")


def test_repeated_server_is_a_sweep_and_the_table_names_each(draft):
    r = run_cli("acceptance", "--draft", str(draft), "--new-tokens", "12", "--server", "sglang@0.5.12",
                "--server", "vllm@0.32.0")
    assert r.returncode in (0, 1), r
    assert "--server sglang@0.5.12" in r.stdout and "--server vllm@0.32.0" in r.stdout and "trained: AL" in r.stdout


def test_configurations_at_tp_1_ride_along_with_the_trained_forward(draft, tmp_path, capsys):
    """Served captures at TP 1 are taken in the trained capture's own pool and forward (where no answer was cut
    short): a sweep of TP-1 configurations starts one pool in all, one more for a TP-2 configuration."""
    import tpsim.app.acceptance as acceptance
    import tpsim.app.sweep as sweep
    calls = []

    def counted(real):
        def on_ranks(job, spec, world, **kwargs):
            calls.append((job.__name__, world))
            return real(job, spec, world, **kwargs)
        return on_ranks

    sweep_file = tmp_path / "sweep.txt"
    sweep_file.write_text("--server sglang@0.5.12\n--server vllm@0.32.0 --draft-ids 1,2,3\n--server sglang@0.5.12 --tp 2\n")
    with pytest.MonkeyPatch.context() as m:
        for module in (acceptance, sweep):
            m.setattr(module, "on_ranks", counted(module.on_ranks))
        code = run_command(["acceptance", "--draft", str(draft), "--new-tokens", "12", "--sweep", str(sweep_file),
                            "--json"], None)
    assert code in (0, 1)
    out = json.loads(capsys.readouterr().out)
    assert all(c["served"]["acceptance_length"] is not None for c in out["configurations"])
    assert calls == [("answers_job", 1), ("captures_many_job", 1), ("captures_many_job", 2)], calls
