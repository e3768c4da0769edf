"""How long the main job takes, and where the time goes: `tpsim check` on the built-in `tiny` model
at TP 1,2,4,8 (what `make check` runs), against a bare `python -c "import torch"` timed beside it.

Whole commands, each a fresh process (median of --repeats): `python -c "import torch"`,
`python -c "import_commands()"` (every command's imports, torch with them: what `import tpsim.cli.main`
imported before issue 35), `tpsim --help` and `tpsim triage --help` (the command line read, no torch
imported), `tpsim check` (ranks forked from the launcher), the same with
TPSIM_RANK_START=forkserver (ranks forked from a fork server that imports torch and tpsim once),
`make check` (the venv already built); `tpsim check` and `make check` each once right after
dropping the page cache (cold; when this user may write /proc/sys/vm/drop_caches), then warm.
Then one launcher in this process runs the same check in phases, --repeats times: the spec (argument parsing, config, validation), the ranks (fork +
rendezvous + process groups), the job on the ranks (on rank 0 by function: the run agreed on,
weights seeded, forwards, comparisons), the report (summarize + print), the pool closed.

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--baseline DIR] [--out benchmarks/results/startup-cpu.json]

--only-help times the two --help lines alone (and the baseline's, with --baseline), into
benchmarks/results/help-cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ["check"]  # the main job: tiny, TP 1,2,4,8
HELP = {"tpsim --help": ["--help"], "tpsim triage --help": ["triage", "--help"]}  # issue 35: under 1 s, no torch


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each command and of the in-process phases")
    ap.add_argument("--out", help="default benchmarks/results/startup-cpu.json (--only-help: help-cpu.json)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold run (it drops the page cache)")
    ap.add_argument("--baseline", metavar="DIR", help="a checkout of an earlier tpsim: its `tpsim check` and --help lines "
                                                      "(PYTHONPATH=DIR) are timed beside this one's, interleaved")
    ap.add_argument("--only-help", action="store_true", help="time only `tpsim --help` and `tpsim triage --help`")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    args.out = args.out or str(ROOT / "benchmarks" / "results" / ("help-cpu.json" if args.only_help else "startup-cpu.json"))
    return args


def wall(cmd: list[str], env: dict) -> float:
    t0 = time.monotonic()
    # the baseline runs in its own checkout: `python -m` puts the working directory first on the path
    r = subprocess.run(cmd, cwd=env.get("PYTHONPATH", ROOT), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"startup.py: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return time.monotonic() - t0


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def commands(repeats: int, cold: bool, baseline: str | None, only_help: bool = False) -> dict:
    """{name: {"runs": [...], "median": s}} for the whole commands, interleaved so that load drifts
    alike over all of them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    py, tpsim = sys.executable, str(Path(sys.executable).with_name("tpsim"))
    cmds = {} if only_help else {
        "python -c 'import torch'": [py, "-c", "import torch"],
        "python -c 'import_commands()'": [py, "-c", "from tpsim.cli.main import import_commands; import_commands()"]}
    cmds.update({k: [tpsim, *argv] for k, argv in HELP.items()})
    if not only_help:
        cmds.update({"tpsim check": [tpsim, *CHECK], "TPSIM_RANK_START=forkserver tpsim check": [tpsim, *CHECK],
                     "make check": ["make", "-s", "check", f"VENV={Path(sys.executable).parent.parent}"]})
    envs = {k: {**env, "TPSIM_RANK_START": "forkserver"} if k.startswith("TPSIM_RANK_START") else env for k in cmds}
    if baseline:
        head, base_py = git_head(baseline), baseline_python()
        for k, argv in [*HELP.items(), *([] if only_help else [("tpsim check", CHECK)])]:
            key = f"{k} @ {head} (--baseline)"
            cmds[key] = [base_py, "-m", "tpsim", *argv]
            envs[key] = {**env, "PYTHONPATH": str(Path(baseline).resolve())}
    out = {}
    if cold and not only_help:
        for k in ("tpsim check", "make check"):
            out[f"{k} (cold: page cache dropped)"] = {"runs": [wall(cmds[k], env)] if drop_page_cache() else []}
    runs = {k: [] for k in cmds}
    wall([tpsim, *(HELP["tpsim --help"] if only_help else CHECK)], env)  # warm the page cache
    for _ in range(repeats):
        for k, cmd in cmds.items():
            runs[k].append(wall(cmd, envs[k]))
    out.update({k: {"runs": v} for k, v in runs.items()})
    for v in out.values():
        v["median"] = statistics.median(v["runs"]) if v["runs"] else None
    return out


def baseline_python() -> str:
    """A venv that sees this one's packages (torch, ...) but not its editable tpsim, whose import hook
    would win over PYTHONPATH: the packages directory is added as a plain path, its .pth files unread."""
    import sysconfig
    import tempfile
    venv = Path(tempfile.mkdtemp(prefix="tpsim-baseline-venv-"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return str(py)


def git_head(where: str) -> str:
    r = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or where


RANK0_PHASES = {  # time in these functions of tpsim.run.jobs on rank 0, inside check_job
    "agree on the run (hashes, all_gather)": "agree_on_run",
    "build the model + seed its weights": "build_model",
    "forwards (capture recorded)": "run_recorded",
    "compare ranks, diagnose": "_compare_ranks",
}


def phases(repeats: int) -> dict:
    """One launcher, the same check as `tpsim check`, timed by phase."""
    from tpsim.bench.jobs import phased_job
    from tpsim.cli.main import build_parser
    from tpsim.cli.check import print_report
    from tpsim.cli.run_args import run_spec, tp_degrees
    from tpsim.parallel.pool import RankPool
    from tpsim.run.jobs import check_job
    from tpsim.app.report import summarize

    got = {k: [] for k in ("spec: parse, config, validate", "ranks: fork + rendezvous + groups", "job on the ranks",
                           *RANK0_PHASES, "report: summarize + print", "close the pool")}
    for _ in range(repeats):
        t = time.perf_counter()
        args = build_parser().parse_args(CHECK)
        tps = tp_degrees(args)
        spec, res = run_spec(args, tps)
        got["spec: parse, config, validate"].append(time.perf_counter() - t)
        t = time.perf_counter()
        pool = RankPool(max(tps), timeout_s=spec.timeout_s)
        got["ranks: fork + rendezvous + groups"].append(time.perf_counter() - t)
        t = time.perf_counter()
        results = pool.run(phased_job, job=check_job, functions=list(RANK0_PHASES.values()), spec=spec, tps=tps)
        got["job on the ranks"].append(time.perf_counter() - t)
        for k, fn in RANK0_PHASES.items():
            got[k].append(results[0][1][fn])
        t = time.perf_counter()
        report = summarize(spec, res, tps, [r for rows, _ in results.values() for r in rows])
        with contextlib.redirect_stdout(io.StringIO()):
            print_report(report, tps)
        got["report: summarize + print"].append(time.perf_counter() - t)
        assert report.ok, "the check failed"
        t = time.perf_counter()
        pool.close()
        got["close the pool"].append(time.perf_counter() - t)
    return {k: {"runs": v, "median": statistics.median(v)} for k, v in got.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    from tpsim.base import ui
    from tpsim.base.atomic import write_json

    whole = commands(args.repeats, not args.no_cold, args.baseline, args.only_help)
    fmt = lambda s: "-" if s is None else f"{s:.2f} s"  # noqa: E731
    ui.table(["command (fresh process)", "median", "runs"],
             [[k, fmt(v["median"]), " ".join(f"{x:.2f}" for x in v["runs"])] for k, v in whole.items()])
    about = {"tpsim": git_head(str(ROOT)), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.only_help:
        write_json(Path(args.out), {"benchmark": "startup --only-help", "command": "tpsim --help, tpsim triage --help",
                                    **about, "load_average_at_end": os.getloadavg(), "repeats": args.repeats,
                                    "commands": whole})
        print(f"wrote {args.out}")
        return 0
    parts = phases(args.repeats)
    torch_s = whole["python -c 'import torch'"]["median"]
    check_s = whole["tpsim check"]["median"]
    ratio = check_s / torch_s
    ui.table(["phase of tpsim check (one launcher)", "median", "runs"],
             [[("  rank 0: " if k in RANK0_PHASES else "") + k, fmt(v["median"]), " ".join(f"{x:.2f}" for x in v["runs"])]
              for k, v in parts.items()])
    print(f"tpsim check / python -c 'import torch' = {ratio:.2f} (target <= 4); make check {fmt(whole['make check']['median'])} "
          "(target < 8 s)")
    result = {"benchmark": "startup", "command": "tpsim " + " ".join(CHECK) + " (tiny, TP 1,2,4,8)", **about,
              "torch": __import__("torch").__version__,
              "load_average_at_end": os.getloadavg(), "repeats": args.repeats, "commands": whole, "phases": parts,
              "check_over_import_torch": ratio}
    write_json(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
