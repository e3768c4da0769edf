"""The self-spawned rank pool fails fast and says which rank failed."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tpsim.base.errors import RankError
from tpsim.base.errors import UsageError
from tpsim.parallel.pool import START_ENV, RankPool, StartMethod, start_method
from tpsim.profiles.conventions import resolve
from tpsim.config.loader import load_config
from tpsim.run.spec import ModelSource, RunSpec, model_path
from tpsim.testing.jobs import (RUN_CHANGES, busy_job, disagree_job, fault_job, mismatch_job, rank_facts_job, report_job,
                                run_disagree_job, slow_job)


@pytest.mark.parametrize("start", list(StartMethod), ids=lambda m: m.value)
@pytest.mark.parametrize("how,message", [("raise", "rank 1 failed while running fault_job: RuntimeError"),
                                         ("die", "rank 1 died (exit code 7) while running fault_job")])
def test_a_failing_rank_brings_the_pool_down_with_its_name(how, message, start):
    pool = RankPool(3, timeout_s=20, start=start)
    start = time.monotonic()
    with pytest.raises(RankError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pool.run(fault_job, rank=1, how=how)
    assert time.monotonic() - start < 20  # well before the collective timeout
    assert pool.closed
    assert all(not p.is_alive() for p in pool._procs)  # no orphan ranks


@pytest.mark.parametrize("reports,message", [
    ({2: (0.0, "Connection closed by peer"), 1: (0.5, "injected fault"), 0: (0.7, "Connection reset by peer")},
     "rank 1 failed while running report_job: RuntimeError: injected fault"),
    ({2: (0.0, "caused by a remote worker crashing"), 0: (0.5, "Timed out waiting 5000ms for recv"), 1: (0.0, None)},
     "rank 1 stalled while running report_job; rank 0 gave up waiting for it after the 20 s collective timeout"),
])
def test_the_root_cause_is_named_even_when_a_symptom_is_heard_first(reports, message):
    """A survivor's "connection closed" can reach the launcher before the failing rank's own
    report (the CI run that found this named rank 3 for rank 1's stall)."""
    pool = RankPool(3, timeout_s=20)
    with pytest.raises(RankError) as info:
        pool.run(report_job, reports=reports)
    assert str(info.value).splitlines()[0].startswith(message), str(info.value)
    assert all(not p.is_alive() for p in pool._procs)


def test_pool_answers_many_jobs():
    with RankPool(2) as pool:
        for _ in range(3):
            out = pool.run(fault_job, rank=-1, how="raise")
            assert out == {0: 2.0, 1: 2.0}  # a real all-reduce over both ranks


def test_the_stall_watchdog_counts_silence_not_total_time():
    """Loading a full-size model takes minutes: a job that keeps reporting progress runs past
    the watchdog's limit, and so does one that computes without a word (DeepSeek-V3's MoE layer on
    a busy 2-core machine took over the 65 s limit, and `tpsim explain` was named stalled); a silent
    idle one is stopped at it with the rank named."""
    with RankPool(2, timeout_s=1, stall_grace_s=1) as pool:  # silence limit: 2 s
        assert pool.run(slow_job, seconds=4, report_every=0.3) == {0: 0, 1: 1}
        assert pool.run(busy_job, seconds=5) == {0: 0, 1: 1}  # 5 s of CPU each: past the limit, on any machine
        start = time.monotonic()
        with pytest.raises(RankError, match=r"rank 0 stalled while running slow_job \(silent for 2 s\)"):
            pool.run(slow_job, seconds=30, report_every=None)
        assert time.monotonic() - start < 10
        assert all(not p.is_alive() for p in pool._procs)


@pytest.mark.parametrize("field,from_rank,expect", [
    ("input ids", 6, r"the ranks disagree on input ids \(ranks 0-5 \w+; ranks 6-7 \w+\)"),
    ("weights", 1, r"the ranks disagree on weights \(rank 0 \w+; ranks 1-7 \w+\)"),
])
def test_ranks_that_disagree_stop_before_any_forward(rank_pool, field, from_rank, expect):
    """A real all_gather of each rank's hashes; every rank raises, none hangs."""
    start = time.monotonic()
    with pytest.raises(UsageError, match=expect):
        rank_pool.run(disagree_job, field=field, from_rank=from_rank)
    assert time.monotonic() - start < 30
    assert rank_pool.run(disagree_job, field=field, from_rank=8) == {r: "ran" for r in range(8)}


@pytest.mark.parametrize("case,expect", [("shape", r"rank 1 shape \[6\]|rank 1 has float32 \[6\]"),
                                         ("dtype", r"another dtype")])
def test_a_collective_mismatch_is_an_error_not_an_abort(case, expect):
    """gloo aborts the process (SIGABRT) when ranks all-reduce different sizes; the group's
    signature check turns it into an error that names the ranks and what differs."""
    with RankPool(2, timeout_s=20) as pool:
        with pytest.raises(RankError, match=r"failed while running mismatch_job.*collective mismatch in all_reduce"
                                            r" at mismatch_job") as info:
            pool.run(mismatch_job, case=case)
    assert "SIGABRT" not in str(info.value)
    import re
    assert re.search(expect, str(info.value).splitlines()[0])


@pytest.mark.parametrize("field", list(RUN_CHANGES))
def test_every_field_of_a_run_is_agreed_on(rank_pool, field):
    """agree_on_run compares every field of the run, each named in the refusal (dropping `input ids`
    from it passed the whole suite: agree() was only tested with its own fields)."""
    cfg = load_config(model_path("tiny"))
    spec = RunSpec(ModelSource("tiny", cfg), 0, "float32", tuple(range(5)),
                   tuple(resolve("sglang-ids", None, cfg.num_hidden_layers).positions))
    with pytest.raises(UsageError, match=rf"the ranks disagree on {field} \(rank 0 \w+; ranks 1-7 \w+\)"):
        rank_pool.run(run_disagree_job, spec=spec, field=field, from_rank=1)
    assert rank_pool.run(run_disagree_job, spec=spec, field=field, from_rank=8) == {r: "ran" for r in range(8)}


@pytest.mark.parametrize("start", list(StartMethod), ids=lambda m: m.value)
def test_every_start_method_gives_its_ranks_the_same_guarantees(start, monkeypatch):
    """Forked from the launcher or from the fork server: each rank has the launcher's environment as it
    is when the pool starts (not the fork server's, started with the first pool), dies with its
    parent (SIGKILL), carries its rank in its name, has SIGTERM's default handler (not the CLI's, a
    fork inherits it) and one torch thread."""
    for value in ("first pool", "second pool"):
        monkeypatch.setenv("TPSIM_TEST_VALUE", value)
        with RankPool(2, timeout_s=20, start=start) as pool:
            facts = pool.run(rank_facts_job, name="TPSIM_TEST_VALUE")
            procs = pool._procs
        assert [facts[r]["comm"] for r in (0, 1)] == ["tpsim rank 0", "tpsim rank 1"]
        for f in facts.values():
            assert f["env"] == value and f["death_signal"] == signal.SIGKILL and f["sigterm_default"], f
            assert f["torch_threads"] == 1, f
        assert all(not p.is_alive() for p in procs)


def test_the_start_method_is_fork_only_where_a_fork_is_safe(monkeypatch):
    monkeypatch.delenv(START_ENV, raising=False)
    alone = threading.active_count() == 1  # this test process, unless an earlier test left a thread running
    assert start_method("cpu") is (StartMethod.FORK if alone else StartMethod.FORKSERVER)
    assert start_method("cuda") is StartMethod.FORKSERVER
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert start_method("cpu") is StartMethod.FORKSERVER  # another thread could hold a lock across the fork
    finally:
        stop.set()
        other.join()
    monkeypatch.setenv(START_ENV, "forkserver")
    assert start_method("cpu") is StartMethod.FORKSERVER
    monkeypatch.setenv(START_ENV, "spawn")
    with pytest.raises(UsageError, match=f"{START_ENV}='spawn' is not one of fork, forkserver"):
        start_method("cpu")


GUARD_PROBE = ("import ctypes, signal, sys; import tpsim.base.forkguard; s = ctypes.c_int(); "
               "ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(s)); "  # PR_GET_PDEATHSIG
               "print(s.value, 'torch' in sys.modules, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)")


@pytest.mark.parametrize("launcher", ["parent", "unset"])
def test_the_fork_servers_guard_runs_before_torch_and_only_for_a_launcher(launcher):
    """The fork server preloads tpsim.base.forkguard before the pool (which imports torch): it must tie the
    server to its launcher without importing torch (it once imported it through tpsim.parallel), and do
    nothing in a process no launcher started."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from tpsim.parallel.pool import rank_context
    env = {k: v for k, v in os.environ.items() if k != "TPSIM_LAUNCHER_PID"}
    if launcher == "parent":
        env["TPSIM_LAUNCHER_PID"] = str(os.getpid())
    out = subprocess.run([sys.executable, "-c", GUARD_PROBE], env=env, capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert out == (["9", "False", "True"] if launcher == "parent" else ["0", "False", "False"])
    from multiprocessing import forkserver
    rank_context(StartMethod.FORKSERVER)
    assert forkserver._forkserver._preload_modules[:2] == ["tpsim.base.forkguard", "tpsim.parallel.pool"]
