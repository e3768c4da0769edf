"""`tpsim observe`: run the installed vLLM (tpsim.engine.runner) and print beside it what tpsim's replay of that
version says (tpsim.app.observe): the model runner, each captured slot identified as a tpsim position, the
acceptance counts, a start-up refusal.

Exit 0 the engine and tpsim agree, 1 they disagree, 2 bad input, 3 a rank failed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tpsim.app.acceptance import measure, served_fed
from tpsim.app.bounds import Cost, check_count, checked_cost
from tpsim.app.prompts import Prompts
from tpsim.app.draft_served import served_findings
from tpsim.app.served_flags import algorithm_findings
from tpsim.app.observe import MATCH, Observation, al_tolerance, compare, identify, known_defect, partial_reference, platform_refusals, reference
from tpsim.app.preflight import check_timeout
from tpsim.app.target import Target, target_for
from tpsim.app.triage import Captures, Inputs, captures
from tpsim.base.errors import UsageError
from tpsim.base.ui import say, table
from tpsim.cli.options import emit_json, positive_int
from tpsim.cli.run_args import request_from, served_tp
from tpsim.app.asks import draft_path, trained_from
from tpsim.cli.served import prompts_ask
from tpsim.draft.checkpoint import DraftCheckpoint, read
from tpsim.draft.findings import DraftDefect
from tpsim.engine.runner import Launch, Observed, engine_version, run
from tpsim.offline.align import read_draft_config
from tpsim.profiles.loader_lines import lookup as loader_lookup
from tpsim.profiles.profile import Profile, Served, SpecAlgorithm
from tpsim.profiles.registry import CPU_BUILD, for_target
from tpsim.profiles.vllm import CPU_NEWEST, assumed, runner
from tpsim.weights.export import export_checkpoint, hf_config
from tpsim.weights.gguf_builtin import cache_root

DEFAULT_ENGINE = ".venv-engine/bin/python"  # `make engine`


@dataclass(frozen=True)
class Planned:
    """One engine launch and what tpsim predicts for it."""

    inputs: Inputs
    caps: Captures
    refusal: list[str]
    launch: Launch
    prompts: Prompts
    checkpoint: DraftCheckpoint
    server: str
    capture_only: bool
    dtype: str
    unprofiled: str | None = None  # the installed version tpsim has no profile for, and why
    cost: Cost | None = None  # tpsim's side of the measurement, checked against the bounds (None: capture only)


def cmd_observe(args) -> int:
    check_timeout(args.timeout)
    steps(args)  # bounded before the engine's interpreter is even asked its version
    limit = positive_int(args.engine_timeout, "--engine-timeout")
    custom_ops(args.custom_ops)
    read_draft_config(str(draft_path(args.draft)))
    python = engine_python(args.engine_python)
    p = plan(args, engine_version(python))
    o = judge(p, run(python, [p.launch], limit)[0])
    emit_json(to_dict(o, p.inputs)) if args.json else print_observation(o, p.inputs, args)
    return 0 if o.agrees or o.unprofiled else 1


def engine_python(given: str | None) -> str:
    return given or os.environ.get("TPSIM_ENGINE_PYTHON") or DEFAULT_ENGINE


def plan(args, engine: tuple[str, str]) -> Planned:
    """The launch `args` ask for and tpsim's replay of it on the engine `engine` (distribution, version)."""
    server = f"{engine[0]}@{engine[1]}"
    k, tp = steps(args), served_tp(args)
    limit = None if args.sequences is None else positive_int(args.sequences, "--sequences")
    path = draft_path(args.draft)
    ckpt, config = read(path), read_draft_config(str(path))
    target = on_disk(target_for(config, args.model, args.override or [], tp), args.seed, config, tp)
    args.model = str(target.source.checkpoint)
    serve, server_as, unprofiled = replayed_as(server, target.real.model_type)
    algorithm = SpecAlgorithm(args.speculative_algorithm)
    inputs = Inputs(trained_from(args.train, target.real.model_type, target.real.num_hidden_layers), serve,
                    Served(tp=tp, server=server_as, algorithm=algorithm), config, request_from(args, sorted({1, tp})),
                    target)
    alone = args.target_only
    capture_only = args.capture_only or alone
    prompts = limited(prompts_ask(args).prompts(target), 1 if capture_only else limit)
    refusal = [] if alone else [f.cause for f in served_findings(ckpt, [], [loader_lookup(server_as)], None, tp)
                                if f.defect is DraftDefect.LOADER_REFUSES]
    refusal += [] if alone else [f.cause for f in algorithm_findings(serve, inputs.served, config.raw)]
    refusal += platform_refusals(serve.platform, target.real, not alone, amx())
    caps = captures(inputs)
    ops = custom_ops(args.custom_ops)
    launch = Launch(target.source.checkpoint, None if alone else path, *engine_prompts(prompts, capture_only), tp=tp,
                    k=k, method=algorithm.value.lower(), max_model_len=min(2048, target.real.max_position_embeddings),
                    dtype="float32" if args.dtype == "auto" else args.dtype, custom_ops=ops,
                    aux_ids=tuple(p.boundary for p in caps.replay.positions) if alone else None)
    # as acceptance bounds its own: k leaves a verify round, the run fits the time and memory bounds (--ignore-limits)
    cost = None if capture_only else checked_cost(prompts, k, target.real, ckpt.config, inputs.request, tp)
    return Planned(inputs, caps, refusal, launch, prompts, ckpt, server, capture_only, args.dtype, unprofiled, cost)


def steps(args) -> int:
    """--steps: a count from 1 to MAX_TOKENS, as acceptance's (vLLM is launched with that many speculative tokens)."""
    k = positive_int(args.steps, "--steps")
    check_count(k, "--steps")
    return k


def replayed_as(server: str, model_type: str) -> tuple[Profile, str, str | None]:
    """The profile tpsim replays beside the installed engine `server`, the server it names; for a version tpsim has
    not profiled, the newest one it has, and why (what the engine does is then an observation, not a prediction)."""
    try:
        return for_target(server, model_type), server, None
    except UsageError as e:
        dist = server.partition("@")[0]
        newest = f"{dist}@{'.'.join(map(str, CPU_NEWEST))}" if dist == CPU_BUILD else f"{dist}@latest"
        why = str(e).split(": ", 1)[-1].split(": give one", 1)[0]
        return for_target(newest, model_type), newest, f"{server} is not profiled ({why})"


def judge(p: Planned, observed: Observed) -> Observation:
    """What the engine did beside tpsim's replay: the slots identified, the acceptance measured, compared."""
    caps, inputs = p.caps, p.inputs
    failure = None if p.launch.draft is None else served_fed(inputs, caps, p.checkpoint.config.capture_width).failure
    if p.launch.draft is None and caps.replay.failure is not None:
        failure = caps.replay.failure
    o = Observation(p.server, observed, runner(inputs.serve.behaviour.config), p.refusal, failure,
                    known=known_defect(inputs.serve.platform, inputs.target.source.cfg, p.launch.custom_ops),
                    unprofiled=p.unprofiled)
    if observed.refused is None and observed.aux and observed.aux[0]:
        ref, tol = reference(inputs, p.launch.tp, p.launch.prompts[0]), MATCH.get(p.dtype, MATCH["float32"])
        o.slots = identify(observed.aux[0][0], ref, tol, list(caps.replay.positions))
        if any(s.position is None for s in o.slots) and p.launch.tp > 1:  # a capture before a deferred all-reduce?
            ref |= partial_reference(inputs, p.launch.tp, p.launch.prompts[0])
            o.slots = identify(observed.aux[0][0], ref, tol, list(caps.replay.positions))
        o.ranks_identical = all(bool((r[0] == observed.aux[0][0]).all()) for r in observed.aux)
    if observed.refused is None and not p.capture_only:
        o.report = measure(inputs, p.checkpoint, p.launch.k, p.prompts, p.cost)
    compare(o, caps)
    return o


def custom_ops(text: str | None) -> tuple[str, ...]:
    """--custom-ops as vLLM's compilation_config.custom_ops takes them: each +NAME, -NAME, all or none."""
    ops = tuple(o.strip() for o in (text or "").split(",") if o.strip())
    for o in ops:
        if o not in ("all", "none") and not (o[:1] in "+-" and o[1:].replace("_", "").isalnum()):
            raise UsageError(f"--custom-ops {o!r}: each op is +NAME (the custom kernel), -NAME (the native path), all "
                             "or none, e.g. --custom-ops=-rotary_embedding")
    return ops


def amx() -> bool:
    """Whether this machine's CPU has AMX tiles, as vLLM's CPU platform asks (the engine runs here)."""
    import platform
    import torch
    return platform.machine() in ("x86_64", "AMD64") and bool(torch.cpu._is_amx_tile_supported())


def on_disk(target: Target, seed: int, config, tp: int) -> Target:
    """The target as a checkpoint directory the engine can load: a seeded built-in is exported once (float32)
    into tpsim's cache, and both sides then read that file."""
    if target.standin is not None:
        raise UsageError(f"--model {target.name} is too big to run here; observe runs the engine and tpsim on the "
                         "same checkpoint: give one that runs here (e.g. --model smollm2-135m)")
    if target.source.checkpoint is not None:
        return target
    hf = hf_config(target.source.cfg, "float32", seed)
    key = hashlib.sha256(json.dumps(hf, sort_keys=True).encode()).hexdigest()[:16]
    out = cache_root() / "engine-targets" / f"{Path(target.name).stem}-{key}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_checkpoint(target.source.cfg, seed, out, "float32", 1 << 31)
    return target_for(config, str(out), [], tp)


def limited(prompts: Prompts, n: int | None) -> Prompts:
    if n is None:
        return prompts
    return Prompts(prompts.sequences[:n], prompts.to_answer[:max(0, n - len(prompts.sequences))], prompts.new_tokens,
                   prompts.stop, prompts.origin + f" (first {n})")


def engine_prompts(prompts: Prompts, capture_only: bool) -> tuple[tuple, tuple]:
    """The prompts as the engine gets them, and how many tokens it generates after each (each answer's length)."""
    given = [(s.tokens[:s.prompt], s.answer) for s in prompts.sequences]
    given += [(tuple(p), prompts.new_tokens) for p in prompts.to_answer]
    if capture_only:
        given = [(given[0][0], 4)]
    return tuple(p for p, _ in given), tuple(n for _, n in given)


def _observed_al(o: Observed) -> str:
    c = o.counts
    if c is None or not c.drafts:
        return "-"
    return f"{c.length:.3f} ({c.drafts} drafts; per position {' / '.join(f'{x:.3f}' for x in c.rates)})"


def _predicted_al(o: Observation) -> str:
    a = None if o.report is None else o.report.served.acceptance
    if a is None:
        return "-" if o.report is None else f"never fed: {o.report.served.fed.failure}"
    return f"{a.length:.3f} ({a.rounds} rounds; per position {' / '.join(f'{x:.3f}' for x in a.per_position)})"


def print_observation(o: Observation, inputs: Inputs, args) -> None:
    v = o.observed
    say(f"tpsim observe: {o.server} (observed: the engine ran) beside tpsim's replay {inputs.serve.name}; draft "
        f"{args.draft} on {inputs.target.name} at TP {inputs.served.tp}")
    say(f"assumed: {assumed(inputs.serve)}")
    if o.unprofiled:
        say(f"not profiled: {o.unprofiled}; beside it, the replay of {inputs.serve.name}, the newest tpsim has: each "
            "difference below is what this version does (observed), not an error of tpsim's to fix")
    for line in v.log:
        say(f"engine log: {line}")
    rows = [("start-up", f"refused: {v.refused}" if v.refused else f"started (load {v.load_s:.0f} s)",
             f"refused: {o.refusal[0]}" if o.refusal else "starts")]
    if v.refused is None:
        rows.append(("model runner", v.runner or "-", o.runner))
        rows.append(("ids read", ", ".join(map(str, v.capture_ids or ())) or "-", caps_ids(inputs)))
        if v.failed is not None:
            rows.append(("serving", f"failed: {v.failed}", f"fails: {o.predicted_failure}" if o.predicted_failure
                         else "serves"))
        for s in o.slots:
            rows.append((f"slot {s.index}", f"{s.position or 'none'} (rel err {s.error:.1e} vs {s.nearest})",
                         str(s.predicted or "-")))
        if o.predicted_failure and not o.slots:
            rows.append(("slots", "none", f"none: {o.predicted_failure}"))
        if o.report is not None:
            rows.append(("AL (served)", _observed_al(v), _predicted_al(o)))
    table(["", "engine (observed)", "tpsim (replay)"], rows)
    if o.report is not None and o.report.served.acceptance is not None:
        say(f"AL agreement: within {al_tolerance(o.report):.3f} (2 standard errors of tpsim's AL, at least 0.02: vLLM "
            "drafts up to max_tokens, tpsim stops k positions before each answer's end)")
    if o.known is not None and o.explained:
        say(f"known engine defect: {o.known}")
        for e in o.explained:
            say(f"  explains {e}")
    for d in o.disagreements:
        say(f"DISAGREES: {d}")
    if o.unprofiled:
        say(f"VERDICT: observed (not profiled): {len(o.disagreements)} difference"
            f"{'s' * (len(o.disagreements) != 1)} from {inputs.serve.name}'s replay")
        return
    say("VERDICT: the engine and tpsim agree" if o.agrees else
        f"VERDICT: {len(o.disagreements)} disagreement{'s' * (len(o.disagreements) > 1)}: a profile or replay to fix")


def caps_ids(inputs: Inputs) -> str:
    got = captures(inputs).config
    return "capture off" if got.off else ", ".join(map(str, got.ids or ())) or "the default"


def to_dict(o: Observation, inputs: Inputs) -> dict:
    v, a = o.observed, None if o.report is None else o.report.served.acceptance
    c = v.counts
    return {"agrees": o.agrees, "disagreements": o.disagreements, "unprofiled": o.unprofiled, "server": o.server, "replay": inputs.serve.name,
            "assumed": assumed(inputs.serve), "tp": inputs.served.tp,
            "known_defect": o.known if o.explained else None, "explained": o.explained,
            "observed": {"version": v.version, "refused": v.refused, "failed": v.failed, "runner": v.runner,
                         "capture_ids": v.capture_ids, "log": list(v.log), "ranks_identical": o.ranks_identical,
                         "slots": [{"slot": s.index, "position": s.position and str(s.position),
                                    "nearest": str(s.nearest), "relative_error": s.error} for s in o.slots],
                         "acceptance": None if c is None else {"length": c.length, "drafts": c.drafts,
                                                               "accepted": c.accepted,
                                                               "per_position": list(c.per_position)}},
            "predicted": {"refused": o.refusal, "runner": o.runner, "failure": o.predicted_failure,
                          "slots": [s.predicted and str(s.predicted) for s in o.slots],
                          "acceptance": None if a is None else {"length": a.length, "rounds": a.rounds,
                                                                "per_position": list(a.per_position)}}}
