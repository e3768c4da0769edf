"""The self-started rank pool: `world` local ranks the launcher forks (or forks from a preloaded
fork server), reused for many jobs, each rank watched: a rank that raises, dies or stays silent
brings the pool down with one line naming it (tpsim.parallel.launch has the rank context they get)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tpsim.base.environ import START_ENV, StartMethod, asked_start_method  # noqa: F401  (START_ENV: imported from here)
from tpsim.base.errors import RankError, UsageError
from tpsim.base import faults
from tpsim.base.procs import proc_stat
from tpsim.base import deathsig
from tpsim.base.forkguard import LAUNCHER_ENV
from tpsim.parallel.launch import RankContext, build_groups


def can_fork() -> bool:
    """Whether a fork of this process is a faithful copy: Linux, no other Python thread (one could
    hold a lock the child then waits on forever: a stream's, logging's), no CUDA context (a child
    cannot use its parent's). Idle OpenMP workers are harmless: a rank runs with one intra-op thread
    and never enters their pool."""
    return sys.platform.startswith("linux") and threading.active_count() == 1 and not torch.cuda.is_initialized()


def start_method(device: str) -> StartMethod:
    """FORK where a fork is safe (can_fork) for CPU ranks; FORKSERVER elsewhere. TPSIM_RANK_START chooses."""
    asked = asked_start_method()
    if asked is not None:
        return asked
    return StartMethod.FORK if device == "cpu" and can_fork() else StartMethod.FORKSERVER


def rank_context(start: StartMethod):
    mp = torch.multiprocessing.get_context(start.value)
    if start is StartMethod.FORKSERVER:
        mp.set_forkserver_preload(["tpsim.base.forkguard", "tpsim.parallel.pool"])  # in order, when the server starts
    return mp


def _worker(rank, world, init_file, backend, device, timeout_s, tasks, results, slot, start, env):
    # First: a launcher gone before this line ends the rank here. A forked rank's parent is the
    # launcher; a fork server's child's is the fork server, which dies with the launcher.
    launcher = int(env[LAUNCHER_ENV])
    deathsig.die_with_parent(launcher if start is StartMethod.FORK else None)
    if not _alive(launcher):
        os._exit(1)
    deathsig.name_process(f"tpsim rank {rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C and kills us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked rank inherits the CLI's unwinding handler
    os.environ.clear()
    os.environ.update(env)  # the launcher's environment now, not the fork server's when it started
    torch.set_num_threads(1)
    # multiprocessing's own files (the socket a tensor's storage is shared through) go under the
    # rendezvous directory, which the launcher removes even when it has to kill this rank
    mp_dir = os.path.join(os.path.dirname(init_file), f"rank{rank}")
    os.makedirs(mp_dir, exist_ok=True)
    multiprocessing.current_process()._config["tempdir"] = mp_dir
    faults.install(slot)
    try:
        faults.doing("starting up (joining the process group)")
        faults.at("startup", rank)
        dev = torch.device(device)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        ctx = RankContext(rank, world, dev, backend, build_groups(rank, world, dev, timeout_s), all_blocks=False,
                          progress_fn=lambda m: results.put(("progress", rank, m)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        return
    results.put(("ready", rank, None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, kwargs = task
        faults.doing(f"running {fn.__name__}")
        try:
            results.put(("ok", rank, fn(ctx, **kwargs)))
        except UsageError as e:
            results.put(("usage", rank, str(e)))
        except BaseException:
            results.put(("error", rank, traceback.format_exc()))
    dist.destroy_process_group()


def _last_line(report: str) -> str:
    return report.strip().splitlines()[-1]


def _says(report: str, *words: str) -> bool:
    """Whether the exception text of a rank's traceback (not its indented frame and source
    lines, which may hold any word) contains one of `words`."""
    message = "\n".join(line for line in report.splitlines() if not line.startswith(" ")).lower()
    return any(w in message for w in words)


def _timed_out(report: str) -> bool:
    return _says(report, "timed out", "timeout")


def peer_symptom(report: str) -> bool:
    """Whether a rank's error is what a peer's death or stall looks like from outside (a lost
    connection or a collective timeout) rather than a fault of its own."""
    return _timed_out(report) or _says(report, "connection", "remote worker", "peer")


RENDEZVOUS_PREFIX = "tpsim-rdzv-"  # + the launcher's pid + "-": a killed launcher's directory is found by the next run


def remove_stale_rendezvous() -> None:
    """Remove the rendezvous directories of launchers that no longer run (SIGKILLed: no cleanup ran)."""
    for d in Path(tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}*-*"):
        pid = d.name[len(RENDEZVOUS_PREFIX):].partition("-")[0]
        if pid.isdecimal() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# A rank silent this long past the collective timeout is named stalled: long enough for its peers'
# own collective timeouts (which name the root cause) to arrive first, short enough that at TP=1,
# where no collective can time out, --timeout still bounds the wait.
STALL_GRACE_S = 5.0
# A rank that used this share of a silence window's time on a CPU is working, not stalled (a
# SIGSTOPped rank, or one blocked on a pipe or a lock, uses none; one waiting in a gloo collective
# next to nothing; a working one on a machine busy with other work still gets far more than this).
WORKING_CPU_SHARE = 0.05


class RankPool:
    """`world` local ranks over gloo (CPU) with a file rendezvous, reused for many jobs.

    `run` sends one job to every rank and returns {rank: result}. A rank that raises, dies,
    or stays silent (no result, no progress) for `timeout_s + stall_grace_s` kills the whole
    pool and raises RankError naming it.
    """

    def __init__(self, world: int, backend: str = "gloo", device: str = "cpu", timeout_s: float = 60.0,
                 env: dict | None = None, on_progress=None, stall_grace_s: float = STALL_GRACE_S,
                 start: StartMethod | None = None):
        self.world, self.backend, self.device, self.timeout_s = world, backend, device, timeout_s
        self.stall_grace_s = stall_grace_s
        self.on_progress = on_progress
        remove_stale_rendezvous()
        self._tmp = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-")
        self.start = start or start_method(device)
        mp = rank_context(self.start)
        self._results = mp.Queue()
        self._tasks = [mp.SimpleQueue() for _ in range(world)]  # no feeder thread here: the next pool may fork
        self._slots = [mp.Array("c", faults.SLOT_BYTES) for _ in range(world)]  # what each rank is doing
        child_env = {"OMP_NUM_THREADS": "1", LAUNCHER_ENV: str(os.getpid()), **(env or {})}
        if sys.platform.startswith("linux"):
            child_env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        rank_env = {**os.environ, **child_env}
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)  # a fork server started now keeps this environment
        # A child inherits the signal mask: Ctrl-C while the fork server imports torch (before tpsim
        # ignores SIGINT there) stays pending and is dropped, not printed as a traceback from inside
        # an import; the launcher gets it as soon as the ranks are started.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._procs = [mp.Process(target=_worker, daemon=True,
                                      args=(r, world, os.path.join(self._tmp, "store"), backend, device, timeout_s,
                                            self._tasks[r], self._results, self._slots[r], self.start, rank_env))
                           for r in range(world)]
            for p in self._procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if on_progress:
            on_progress(f"starting {world} {backend} rank{'s' if world > 1 else ''}")
        self.closed = False
        try:
            # a fork server's first pool waits for it to import torch: seconds, a minute on a busy machine
            self._collect("starting", extra_s=60 if self.start is StartMethod.FORKSERVER else 0)
        except BaseException:
            self.kill()
            raise

    def _collect(self, doing: str, extra_s: float = 0.0) -> dict:
        got: dict[int, object] = {}
        # The collective timeout fires first; this catches a rank stuck elsewhere. It counts
        # silence: every progress message (weights report every few seconds) restarts it, and so
        # does a rank that is computing (a long forward on a busy machine says nothing for minutes).
        limit = self.timeout_s + self.stall_grace_s + extra_s
        deadline = time.monotonic() + limit
        cpu = self._cpu_seconds()
        while len(got) < self.world:
            try:
                kind, rank, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = self._dead(exclude=got)
                if dead is not None:  # seen before any report: the survivors' reports still say what followed
                    what = self._what(dead)
                    errors = self._drain_errors(grace_s=3.0, done=set(got) | {dead})
                    self.kill()
                    lost = next((r for r, p in errors.items() if peer_symptom(p)), None)
                    then = "" if lost is None else f"; rank {lost} then lost the connection to it"
                    raise RankError(f"rank {dead} {self._death(dead)} while {doing}{what}{then}")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world)) - set(got))
                    now = self._cpu_seconds()
                    if any(now.get(r, 0.0) - cpu.get(r, 0.0) >= WORKING_CPU_SHARE * limit for r in missing):
                        deadline, cpu = time.monotonic() + limit, now
                        continue
                    what = self._what(missing[0])
                    self.kill()
                    raise RankError(f"rank {missing[0]} stalled while {doing}{what} "
                                    f"(silent for {limit:.0f} s)")
                continue
            if kind == "progress":
                deadline, cpu = time.monotonic() + limit, self._cpu_seconds()
                if self.on_progress:
                    self.on_progress(payload)
            elif kind == "usage":
                self.kill()
                raise UsageError(payload)
            elif kind == "error":
                raise self._failure(rank, payload, got, doing)
            else:
                got[rank] = payload
        return got

    def _cpu_seconds(self) -> dict[int, float]:
        """{rank: CPU seconds its process has used} (Linux /proc; {} elsewhere, where only progress
        messages restart the watchdog)."""
        stats = {r: proc_stat(p.pid) for r, p in enumerate(self._procs)}
        return {r: s.cpu_s for r, s in stats.items() if s is not None}

    def _what(self, rank: int) -> str:
        """", during all_reduce in model.layers.2..." (nothing when the rank was just running the job)."""
        what = faults.read(self._slots[rank])
        return "" if not what or what.startswith("running ") else f", during {what}"

    def _death(self, rank: int) -> str:
        code = self._procs[rank].exitcode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"died (exit code {code})"

    def _failure(self, rank: int, payload: str, got: dict, doing: str) -> RankError:
        """The error to raise when `rank` reported an exception: name the root cause. A peer's
        death reaches the survivors as "connection closed"; a stalled peer as a collective
        timeout, while the stalled rank itself stays silent. The first report to arrive need
        not be the cause (a survivor's "connection closed" can overtake the failing rank's own
        report), so the reports of the next few seconds are read before choosing."""
        errors = {rank: payload} | self._drain_errors(grace_s=3.0, done=set(got) | {rank})
        dead = self._dead(exclude=set(got) | set(errors), grace_s=1.0)  # reporters exit with code 0
        own = [r for r, p in errors.items() if not peer_symptom(p)]
        silent = [r for r in range(self.world) if r not in errors and r not in got and self._procs[r].is_alive()]
        culprit = {r: self._what(r) for r in [dead, *own[:1], *silent[:1]] if r is not None}
        self.kill()
        if dead is not None:
            last = _last_line(payload)
            lost = peer_symptom(payload)
            then = "lost the connection to it" if lost else f"failed: {last}"
            return RankError(f"rank {dead} {self._death(dead)} while {doing}{culprit[dead]}; "
                             f"rank {rank} then {then}\n{payload}")
        if own:
            r = own[0]
            return RankError(f"rank {r} failed while {doing}{culprit[r]}: {_last_line(errors[r])}\n{errors[r]}")
        if silent:
            s = silent[0]
            waiter = next((r for r, p in errors.items() if _timed_out(p)), rank)
            return RankError(f"rank {s} stalled while {doing}{culprit[s]}; rank {waiter} gave up waiting "
                             f"for it after the {self.timeout_s:g} s collective timeout{self._what(waiter)}"
                             f"\n{errors[waiter]}")
        return RankError(f"rank {rank} failed while {doing}{self._what(rank)}: {_last_line(payload)}\n{payload}")

    def _drain_errors(self, grace_s: float, done: set[int]) -> dict[int, str]:
        """{rank: report} for the ranks that report an error within grace_s, stopping early once
        every rank not in `done` has reported or exited."""
        errors, deadline = {}, time.monotonic() + grace_s
        while time.monotonic() < deadline:
            pending = [r for r in range(self.world) if r not in done and r not in errors]
            if all(self._procs[r].exitcode not in (None, 0) for r in pending):
                break
            try:
                kind, rank, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "error":
                errors[rank] = payload
        return errors

    def _dead(self, exclude, grace_s: float = 0.0) -> int | None:
        """The first rank whose process has exited (waiting up to grace_s for one to)."""
        deadline = time.monotonic() + grace_s
        while True:
            for r, p in enumerate(self._procs):  # exit code 0: a rank that reported its error and left
                if p.exitcode not in (None, 0) and r not in exclude:
                    return r
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def run(self, fn: Callable, **kwargs) -> dict:
        if self.closed:
            raise RankError("the rank pool is closed")
        for q in self._tasks:
            q.put((fn, kwargs))
        return self._collect(f"running {fn.__name__}")

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._results.close()
        self._cleanup()

    def close(self) -> None:
        if self.closed:
            return
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self.kill()

    def _cleanup(self) -> None:
        self.closed = True
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:  # interrupted (Ctrl-C, SIGTERM) or failed: the ranks may be mid-job, stop them now
            self.kill()
