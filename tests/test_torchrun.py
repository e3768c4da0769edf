"""`tpsim check` under a real torchrun: one launch builds subgroups of every TP degree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tpsim

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(tpsim.__file__).resolve().parent


def torchrun(*args, nproc=4):
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not on PATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([exe, "--standalone", f"--nproc-per-node={nproc}", "-m", "tpsim", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_check_under_torchrun_builds_every_degree():
    r = torchrun("check", "--json", "--seq-len", "9", "--layers=-1,3,6")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"]
    # 4 ranks: four TP=1 groups, two TP=2 groups, one TP=4 group; every rank reports each degree
    assert [(row["tp"], row["ranks"]) for row in report["rows"]] == [(1, 4), (2, 4), (4, 4)]
    for row in report["rows"]:
        assert row["expected_shape"] == [9, 3 * 64]
        assert row["all_reduces"] == (17 if row["tp"] > 1 else 0)


def test_tp_not_dividing_the_world_is_a_usage_error():
    r = torchrun("check", "--tp", "3", nproc=2)
    assert r.returncode != 0
    assert "tpsim: error: --tp 3 does not divide the torchrun world size 2" in r.stderr
    assert r.stderr.count("tpsim: error:") == 1  # rank 0 reports; the others exit quietly
    # torchrun prints its own ChildFailedError traceback; no frame of it may be in tpsim's own modules
    # (not "/tpsim/" anywhere: a clone's path may hold it, and torchrun's frames then do too)
    assert f'File "{PACKAGE}{os.sep}' not in r.stderr


def test_a_killed_rank_is_blamed_not_the_rank_that_lost_its_connection():
    """torchrun's rank 1 SIGKILLed in the embedding's all-reduce: tpsim's rank 0 said "rank 0 failed
    ... Connection reset"; it now names rank 1, as the self-spawned pool does."""
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if exe is None:
        pytest.skip("torchrun is not on PATH")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TPSIM_FAULT": "1:model.embed_tokens:kill"}
    r = subprocess.run([exe, "--standalone", "--nproc-per-node=2", "-m", "tpsim", "check", "--tp", "2", "--seq-len",
                        "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("tpsim: error:")]
    assert len(lines) == 1 and lines[0].startswith("tpsim: error: rank 1 died"), r.stderr[-3000:]
