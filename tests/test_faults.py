"""Rank faults, end to end: `tpsim capture` with a rank that raises, is killed (SIGKILL) or
stalls at start-up, in the embedding's all-reduce, in a layer's all-reduce, or while the
launcher writes the output. Each run must end within the collective timeout (plus a stated
margin) with exit 3 and one line naming the failing rank and what it was doing, leave no
process and no rendezvous directory behind, and never leave a partial output file.

The fault runs are forks of the CLI server (clirun.run_cli: each in a session of its own, where
a process left behind is found); the tests of a launcher killed or stopped from outside start
`python -m tpsim` themselves, their processes marked by an environment variable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clirun import cli_env, run_cli
from tpsim.base.procs import all_procs
from tpsim.parallel.pool import STALL_GRACE_S

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5  # --timeout: the collective timeout the stalls run into
# A run ends within the collective timeout, the watchdog's grace and the 3 s in which the launcher
# reads the other ranks' reports, plus 25 s for everything else on a busy 2-core machine
BOUND_S = TIMEOUT_S + STALL_GRACE_S + 3 + 25

LAYER = "model.layers.2.self_attn.o_proj"
CASES = {  # id: (TPSIM_FAULT, expected exit, substrings of the one error line)
    "startup-raise": ("1:startup:raise", 3, ["rank 1 failed while starting", "injected fault at startup"]),
    "startup-kill": ("1:startup:kill", 3, ["rank 1 was killed by SIGKILL while starting"]),
    "startup-stall": ("1:startup:stall", 3, ["rank 1 stalled while starting", "5 s collective timeout"]),
    "embed-raise": ("1:model.embed_tokens:raise", 3,
                    ["rank 1 failed while running capture_job", "all_reduce in model.embed_tokens", "injected"]),
    "embed-kill": ("0:model.embed_tokens:kill", 3,
                   ["rank 0 was killed by SIGKILL while running capture_job", "all_reduce in model.embed_tokens"]),
    "embed-stall": ("1:model.embed_tokens:stall", 3, ["rank 1 stalled", "all_reduce in model.embed_tokens"]),
    "layer-raise": (f"2:{LAYER}:raise", 3, ["rank 2 failed", f"all_reduce in {LAYER}", "injected fault"]),
    "layer-kill": (f"3:{LAYER}:kill", 3, ["rank 3 was killed by SIGKILL", f"all_reduce in {LAYER}",
                                          "lost the connection to it"]),
    "layer-stall": (f"1:{LAYER}:stall", 3, ["rank 1 stalled", f"all_reduce in {LAYER}", "gave up waiting"]),
    "write-raise": ("launcher:write:raise", 4, ["could not write the output", "nothing was replaced"]),
    "write-kill": ("launcher:write:kill", -signal.SIGKILL, []),
    # the other families: the same contract, faults in their own modules (GQA's o_proj, GPT-OSS's MoE all-reduce)
    "llama-layer-stall": (f"1:{LAYER}:stall", 3, ["rank 1 stalled", f"all_reduce in {LAYER}", "gave up waiting"]),
    "qwen3-moe-layer-kill": ("2:model.layers.3.mlp:kill", 3, ["rank 2 was killed by SIGKILL",
                                                              "all_reduce in model.layers.3.mlp"]),
    "gpt-oss-moe-raise": ("3:model.layers.1.mlp:raise", 3, ["rank 3 failed", "all_reduce in model.layers.1.mlp",
                                                            "injected fault"]),
}
MODELS = {"llama-layer-stall": "tiny-llama", "qwen3-moe-layer-kill": "tiny-qwen3-moe",
          "gpt-oss-moe-raise": "tiny-gpt-oss"}  # the rest run the default, tiny


def marked_processes(marker: str) -> list[int]:
    """Live processes started with TPSIM_TEST_MARKER=marker (the CLI and every rank it spawned)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"TPSIM_TEST_MARKER={marker}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (a forked run and every rank it started: none leaves it)."""
    return [p.pid for p in all_procs() if p.session == sid and p.state != "Z"]


def run_fault(case: str, tmp: Path) -> dict:
    fault, _, _ = CASES[case]
    out = tmp / "capture.safetensors"
    out.write_bytes(b"the previous capture")
    env = {**cli_env(), "TPSIM_FAULT": fault, "TMPDIR": str(tmp)}
    r = run_cli("capture", "--model", MODELS.get(case, "tiny"), "--tp", "4", "--timeout", TIMEOUT_S, "--seq-len", "4",
                "--out", out, "--force", env=env, timeout_s=300)
    deadline = time.monotonic() + 10  # PDEATHSIG is immediate; allow the kernel a moment
    while in_session(r.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"code": r.returncode, "stderr": r.stderr, "stdout": r.stdout, "seconds": r.seconds,
            "survivors": in_session(r.pid), "out": out.read_bytes(),
            "rdzv": [x.name for x in tmp.iterdir() if x.name.startswith("tpsim-rdzv-")],
            "litter": sorted(x.name for x in tmp.iterdir() if x.name != out.name)}


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    with ThreadPoolExecutor(5) as ex:  # the stalls mostly wait out their timeouts
        futures = {c: ex.submit(run_fault, c, tmp_path_factory.mktemp(c)) for c in CASES}
        return {c: f.result() for c, f in futures.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_brings_every_rank_down_with_one_clear_line(fault_runs, case):
    r = fault_runs[case]
    _, code, expect = CASES[case]
    assert r["code"] == code, r
    assert r["seconds"] < BOUND_S, f"took {r['seconds']:.1f} s"
    assert r["survivors"] == [], f"processes left behind: {r['survivors']}"
    assert r["rdzv"] == [], "rendezvous files left behind"
    assert r["out"] == b"the previous capture", "the previous output was replaced or damaged"
    if code != -signal.SIGKILL:
        lines = [x for x in r["stderr"].splitlines() if x.startswith("tpsim: error: ")]
        assert len(lines) == 1 and "Traceback" not in r["stderr"], r
        for e in expect:
            assert e in lines[0], (e, lines[0])
    else:  # the launcher itself was killed between writing the temporary copy and the rename
        assert all(x.endswith(".tmp") and x.startswith(".capture.safetensors.") for x in r["litter"]), r["litter"]


def _launch_and_wait_for_the_forward(tmp: Path, marker: str) -> tuple[subprocess.Popen, Path]:
    """`tpsim capture --tp 2` whose rank 1 stalls in the embedding; returns once the ranks run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(TPSIM_FAULT="1:model.embed_tokens:stall", TPSIM_TEST_MARKER=marker, TMPDIR=str(tmp),
               OMP_NUM_THREADS="1")
    log = tmp / "stderr.txt"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "tpsim", "capture", "--tp", "2", "--timeout", "120",
                              "--out", str(tmp / "c.safetensors")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=err)
    deadline = time.monotonic() + 120
    while "forward" not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "forward" in log.read_text(), log.read_text()
    return p, log


def _rendezvous(tmp: Path) -> list[str]:
    return [x.name for x in tmp.iterdir() if x.name.startswith("tpsim-rdzv-")]


def test_a_terminated_launcher_stops_its_ranks_and_removes_its_rendezvous(tmp_path):
    """SIGTERM to the launcher mid-run: the ranks stop now and the rendezvous directory goes (it was
    left behind after any SIGTERM)."""
    marker = uuid.uuid4().hex
    p, _ = _launch_and_wait_for_the_forward(tmp_path, marker)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(marker) == []
    assert _rendezvous(tmp_path) == []


def test_the_next_run_removes_a_killed_launchers_rendezvous(tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: its directory (named by its pid) is removed
    by the next run on the machine, and a live launcher's directory is left alone."""
    marker = uuid.uuid4().hex
    p, _ = _launch_and_wait_for_the_forward(tmp_path, marker)
    p.kill()
    p.wait(timeout=60)
    left = _rendezvous(tmp_path)
    assert len(left) == 1 and left[0].startswith(f"tpsim-rdzv-{p.pid}-"), left
    live = tmp_path / f"tpsim-rdzv-{os.getpid()}-live"  # this test process is alive
    live.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TPSIM_FAULT", None)
    r = subprocess.run([sys.executable, "-m", "tpsim", "check", "--tp", "1", "--seq-len", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _rendezvous(tmp_path) == [live.name]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_launcher_killed_while_its_ranks_start_leaves_no_process(tmp_path, sig, start):
    """The launcher killed while its ranks start: spawned ranks still importing torch were re-parented
    to PID 1 and lived on, blocked on a pipe. A forked rank ties its life to its parent first thing;
    the fork server does from its first preloaded module (tpsim.base.forkguard, before torch), and its ranks to it."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(TPSIM_TEST_MARKER=marker, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", TPSIM_RANK_START=start)
    env.pop("TPSIM_FAULT", None)
    p = subprocess.Popen([sys.executable, "-m", "tpsim", "capture", "--tp", "4", "--out", str(tmp_path / "c.safetensors")],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(marked_processes(marker)) < 5 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the launcher and its 4 ranks (plus, soon, the resource tracker)
    assert p.poll() is None and len(marked_processes(marker)) >= 5, "the ranks never started"
    p.send_signal(sig)
    p.wait(timeout=60)
    deadline = time.monotonic() + 15
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_processes(marker) == [], "processes outlived their launcher"


def test_a_silent_rank_at_tp_1_is_named_within_the_timeout(tmp_path):
    """TP=1 runs no collective, so only the launcher's silence limit can catch a stopped rank: it
    was timeout + 30 s (43 s at --timeout 10); now timeout + STALL_GRACE_S."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(TPSIM_TEST_MARKER=marker, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("TPSIM_FAULT", None)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "tpsim", "check", "--tp", "1", "--timeout", "5", "--model",
                              "deepseek-v2-lite", "--override", "num_hidden_layers=2", "--layers", "0", "--seq-len", "4"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    while "TP=1" not in log.read_text() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the rank is building its weights
    rank = [pid for pid in marked_processes(marker) if Path(f"/proc/{pid}/comm").read_text().startswith("tpsim rank")]
    assert p.poll() is None and rank, log.read_text()
    for pid in rank:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    code = p.wait(timeout=120)
    waited = time.monotonic() - t0
    assert code == 3 and "rank 0 stalled" in log.read_text(), log.read_text()
    assert waited < 5 + STALL_GRACE_S + 5, f"named after {waited:.1f} s"
    deadline = time.monotonic() + 10
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in marked_processes(marker)}
    assert left == {}
