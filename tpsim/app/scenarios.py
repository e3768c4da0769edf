"""Ready-made scenarios (`configs/scenarios/*.yaml`): one real capture bug each, the tpsim
commands that show it, and the finding tpsim must print for the bug to count as caught.

A scenario file holds `description` (the bug, in words), `bug_class` (one of BUG_CLASSES),
`sources` (where the bug is shown: PR, issue, or repo path@commit), `argv` (one tpsim command) or
`steps` (several; each but the last must exit 0), and what the last command must do:
`expect_exit`, `finding` (the substring of its output that names the bug: the line holding it is
the scenario's reason) and `expect` (more substrings it must print, e.g. the fix). In commands and expectations `{tmp}` is a fresh temporary directory and
`{configs}` the built-in configs' directory, so every command printed runs from anywhere.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.base.errors import UsageError
from tpsim.app import forked

SCENARIOS = BUILTIN_CONFIGS / "scenarios"

# The classes of capture bug tpsim replays (the issue that filed the scenarios lists them).
BUG_CLASSES = {
    "off-by-one": "ids copied between conventions without translation",
    "embedding-slot": "an embedding slot the draft never saw in training",
    "key-fallback": "ids at a config key the engine does not read: its default is used",
    "ar-fusion-partial": "a capture of the partial sums an all-reduce fusion leaves between layers",
    "ep-token-shard": "a capture of the token shard that expert parallelism leaves on each rank",
    "sp-token-shard": "a capture of the token shard that sequence parallelism leaves on each rank",
    "dp-attention-local": "DP attention's MLP gather given a rank-local token count below the rank's rows",
    "unreachable-last-layer": "an id past the last boundary the capture loop reaches",
    "wrong-layer": "a capture of another layer than the one the draft was trained on",
    "before-all-reduce": "a capture taken before a row-parallel all-reduce",
    "pp-early-return": "aux states captured on a non-last pipeline stage never reach the draft",
    "tbo-region": "layers run as two-batch-overlap micro-batches outside the capture loop",
    "graph-before-capture-set": "CUDA graphs captured before the capture set was known: nothing captured",
    "graph-default-ids": "CUDA-graphed batches capture the default ids, not the configured ones",
    "dropped-id": "an id the engine silently never matches: the capture is narrower",
    "embed-crash": "an id on the embedding crashes the engine's capture loop",
    "in-place-aliasing": "a captured residual modified afterwards by a fused in-place norm",
    "capture-off": "capture switched off or given no layers",
    "ep-gather-threshold": "a capture all-gathered only after a hard-coded layer: shapes mixed",
    "list-order": "a trainer concatenating in list order where the engine captures ascending",
    "pp-refused": "the engine refuses pipeline parallelism with an EAGLE-3 draft at start-up: nothing runs",
    "pp-stage-local": "a pipeline stage numbering its layers from 0: a later stage captures other boundaries",
    "packer-slot-count": "a packing engine fails the forward when it captures fewer slots than ids",
    "aux-count": "a draft trained on other than three aux states, served by a loader that builds fc for three",
    "capture-ignored": "a model class that declares EAGLE-3 support and never takes the ids: no aux states",
    "pd-hidden-width": "PD disaggregation hands the decode server a state wider or narrower than its buffer",
    "returned-rows": "hidden states returned per request with fewer rows than tokens (a return path that drops them)",
    "micro-batch-merge": "micro-batches whose (hidden, aux) outputs the engine merges as plain tensors: it fails",
    "prefix-cache": "a radix-cache hit runs only the uncached suffix: the capture covers the suffix's rows only",
    "algorithm-flag": "an EAGLE-3 draft served under the EAGLE algorithm: no aux states, fc skipped or refused",
    "fc-width-skip": "captured states together as wide as the draft's embedding: SGLang's width test skips fc",
    "draft-vocab-split": "a draft vocabulary whose padded rows do not split over TP: the engine refuses to start",
    "draft-embed-verdict": "TP ranks judge the draft's embed_tokens against the target's on their own shards: they "
                           "build different drafts",
    "verify-no-broadcast": "a greedy verify with no TP broadcast: ranks accept different draft counts, then deadlock",
    "mtp-feedback-norm": "an MTP/NextN head fed the pre-norm hidden where it was trained on the post-norm one (or the "
                         "reverse), at step 0 or between steps",
    "dflash-fallback-ids": "a DFlash draft without target_layer_ids: the engine computes other taps than trained",
    "dspark-runner-v1": "a DSpark draft where vLLM's runner v1 serves: it never extracts the aux states, or refuses",
    "dflash-last-layer-index": "the last decoder layer in a DFlash draft's ids indexes past the model's layers",
    "block-fc-width": "a DFlash or DSpark draft's fc sized from other ids than the target taps: weight load or the "
                      "first forward fails",
}


@dataclass(frozen=True)
class Scenario:
    """One bug replayed from configs/scenarios/: the tpsim commands that reproduce it, and the exit code and
    finding that show tpsim caught it."""

    name: str
    description: str
    bug_class: str
    sources: tuple[str, ...]
    steps: tuple[tuple[str, ...], ...]
    expect_exit: int
    finding: str
    expect: tuple[str, ...]

    def commands(self, tmp: str) -> list[list[str]]:
        return [[fill(a, tmp) for a in step] for step in self.steps]

    def expected(self, tmp: str = "") -> list[str]:
        """Every substring the last command must print, the finding first."""
        return [fill(e, tmp) for e in (self.finding, *self.expect)]

    @property
    def summary(self) -> str:
        return " ".join(self.description.split())


@dataclass(frozen=True)
class Outcome:
    """What running a scenario showed: `caught` when the last command exited as expected and
    printed every expected finding; `reason` is the output line holding the first one (or what
    was missing)."""

    scenario: Scenario
    caught: bool
    reason: str
    exit_code: int
    seconds: float
    output: str

    def to_dict(self) -> dict:
        s = self.scenario
        return {"name": s.name, "bug_class": s.bug_class, "sources": list(s.sources), "caught": self.caught,
                "reason": self.reason, "exit_code": self.exit_code, "seconds": round(self.seconds, 2),
                "commands": [["tpsim", *c] for c in s.commands("{tmp}")]}


def fill(text, tmp: str) -> str:
    return str(text).replace("{configs}", str(BUILTIN_CONFIGS)).replace("{tmp}", tmp)


def available(where: Path = SCENARIOS) -> list[str]:
    return sorted(p.stem for p in where.glob("*.yaml"))


def load(name: str, where: Path = SCENARIOS) -> Scenario:
    if name not in available(where):  # not a path: ../tiny would name configs/tiny.yaml
        raise UsageError(f"unknown scenario {name!r}; tpsim scenario --list shows {', '.join(available(where))}")
    path = where / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    missing = [k for k in ("description", "bug_class", "sources", "expect_exit", "finding") if k not in raw]
    if missing or not (raw.get("argv") or raw.get("steps")):
        raise UsageError(f"scenario file {path} lacks {', '.join(missing) or 'argv or steps'}; "
                         "see tpsim/app/scenarios.py for the fields")
    if raw["bug_class"] not in BUG_CLASSES:
        raise UsageError(f"scenario file {path}: unknown bug_class {raw['bug_class']!r}; use one of "
                         f"{', '.join(BUG_CLASSES)}")
    steps = raw.get("steps") or [raw["argv"]]
    return Scenario(name, str(raw["description"]), raw["bug_class"], tuple(str(s) for s in raw["sources"]),
                    tuple(tuple(str(a) for a in st) for st in steps), int(raw["expect_exit"]),
                    str(raw["finding"]), tuple(str(e) for e in raw.get("expect", [])))


def run(spec: Scenario, echo=None) -> Outcome:
    """Run every command of `spec` as `python -m tpsim` (a fork of this process where safe) in a
    fresh directory; `echo(text)`
    hears each command line and its output."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpsim-scenario-") as tmp:
        commands = spec.commands(tmp)
        for i, argv in enumerate(commands):
            if echo:
                echo(f"$ tpsim {shlex.join(argv)}")
            code, text = _run_step(argv, tmp)
            if echo:
                echo(text.rstrip("\n"))
            if i < len(commands) - 1 and code != 0:
                return Outcome(spec, False, f"step {i + 1} exited {code}: {_last_line(text)}",
                               code, time.monotonic() - start, text)
        expected = spec.expected(tmp)
        missing = [e for e in expected if e not in text]
        if code != spec.expect_exit:
            why = f"exit {code}, expected {spec.expect_exit}: {_last_line(text)}"
        elif missing:
            why = f"the output lacks {missing[0]!r}"
        else:
            why = next(line.strip() for line in text.splitlines() if expected[0] in line)
        caught = code == spec.expect_exit and not missing
        return Outcome(spec, caught, why, code, time.monotonic() - start, text)


def _run_step(argv: list[str], cwd: str) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `python -m tpsim ARGV` in `cwd`: a fork of this process where
    that is safe (tpsim.app.forked: no second import of torch), else a new interpreter."""
    if not forked.can_fork():
        p = subprocess.run([sys.executable, "-m", "tpsim", *argv], cwd=cwd, capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr
    with tempfile.TemporaryDirectory(prefix="tpsim-step-") as out:
        paths = [Path(out, "stdout"), Path(out, "stderr")]
        ended = forked.run(argv, cwd, dict(os.environ), *paths)
        return ended.status, "".join(p.read_text(errors="replace") for p in paths)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
