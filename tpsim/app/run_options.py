"""The rules of the options that add a dimension to a run: --pp (a pipeline of stages, the layers
split and the capture handed over as the engine replayed does) and --cuda-graph (which capture set
the engine's graphs freeze), checked against the config, the mode and the degrees."""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.app.preflight import torchrun_world
from tpsim.base.errors import UsageError
from tpsim.capture.pipeline import PP_CAPTURES, Handoff, numbered_on
from tpsim.config.loader import ModelConfig
from tpsim.modes import Mode
from tpsim.parallel.pipeline import SPLITS, Split, check_pp
from tpsim.parallel.torchrun import under_torchrun
from tpsim.profiles.findings import Finding, Kind
from tpsim.profiles.profile import GraphIds, Profile
from tpsim.profiles.registry import all_profiles, later_profiles, lookup
from tpsim.profiles.replay import replay
from tpsim.profiles.resolution import Resolution
from tpsim.run.graphs import CudaGraphs
from tpsim.run.pipeline import Pipeline

GRAPH_IDS = {g.name.lower(): g for g in GraphIds}
DEFAULT_GRAPH_TOKENS = 4  # a decode batch: SGLang graphs batch sizes up to --cuda-graph-max-bs


@dataclass(frozen=True)
class PipelineAsk:
    """--pp and its options (size 1: no pipeline parallelism)."""

    size: int = 1
    split: str | None = None
    capture: str | None = None


@dataclass(frozen=True)
class GraphsAsk:
    """--cuda-graph and its options (`on` False: no graphed batch)."""

    on: bool = False
    ids: str | None = None
    tokens: int | None = None


def pipeline_for(ask: PipelineAsk, server: str | None, cfg: ModelConfig, tps: list[int], mode: Mode) -> Pipeline | None:
    """The Pipeline asked for (None without --pp > 1), checked against the config, the mode, every
    TP degree and, under torchrun, the world."""
    pp, split, capture = ask.size, ask.split, ask.capture
    if pp == 1:
        for option, value in (("--pp-split", split), ("--pp-capture", capture)):
            if value is not None:
                raise UsageError(f"{option} applies with --pp 2 or more; add --pp N or drop {option}")
        return None
    check_pp(pp, cfg.num_hidden_layers)
    refusal = mode.pipeline_refusal(pp)
    if refusal is not None:
        raise UsageError(refusal)
    if under_torchrun():
        bad = next((t for t in tps if pp * t != torchrun_world()), None)
        if bad is not None:
            raise UsageError(f"under torchrun --pp {pp} x --tp {bad} = {pp * bad} ranks, but the world has "
                             f"{torchrun_world()}; launch {pp * bad} ranks or use --tp {torchrun_world() // pp}")
    if server is not None:
        for option, value in (("--pp-split", split), ("--pp-capture", capture)):
            if value is not None:
                raise UsageError(f"--server {server} decides {option[5:]} (its engine's behaviour); drop {option}")
        profile = lookup(server, cfg.model_type)
        if profile.behaviour.pp is None:
            raise UsageError(f"profile {profile.name} has no pipeline-parallel behaviour; use an engine profile "
                             "(sglang, vllm) or --pp-capture")
        engine = Split(profile.engine) if profile.engine in SPLITS else Split.SGLANG
        cited = profile.behaviour.pp
        handoff = Handoff.LAST_STAGE_ONLY if cited.value is Handoff.STAGE_LOCAL else cited.value  # numbering: pp_replay
        return Pipeline(pp, engine, handoff, f"{profile.name}: {cited.value.value}; {cited.source}")
    if split is not None and split not in SPLITS:
        raise UsageError(f"unknown --pp-split {split!r}; use one of {', '.join(SPLITS)}")
    if capture is not None and capture not in PP_CAPTURES:
        raise UsageError(f"unknown --pp-capture {capture!r}; use one of {', '.join(PP_CAPTURES)}")
    handoff = PP_CAPTURES[capture] if capture else Handoff.HANDOFF
    return Pipeline(pp, Split(split or "sglang"), handoff, f"--pp-capture {capture}" if capture else "")


def startup_refusal(profile: Profile, pp: int, architecture: str) -> str | None:
    """What the engine says when it will not launch at --pp `pp` with an EAGLE-3 draft (None: it launches),
    with the release whose check says it and what a later release says instead."""
    cited = profile.behaviour.pp
    if pp < 2 or cited is None or cited.value is not Handoff.REFUSED:
        return None
    line = [q for q in all_profiles() if (q.engine, q.family) == (profile.engine, profile.family)]
    first = next(q for q in line if q.behaviour.pp is not None and q.behaviour.pp.error == cited.error)
    later = [q for q in later_profiles(profile) if q.behaviour.pp is not None and q.behaviour.pp.error != cited.error]
    since = first.versions.since.release if first.versions.since else "the oldest release"
    launches = next((q for q in later if q.behaviour.pp.value is not Handoff.REFUSED), None)
    then = (f"; {later[0].versions.since.release} refuses it in other words: {later[0].behaviour.pp.error}"
            if later and later[0].behaviour.pp.value is Handoff.REFUSED else "")
    after = f"{launches.name} launches it" if launches else "no later release tpsim knows launches it"
    said = cited.error.replace("{architecture}", architecture)
    return (f"{profile.name} refuses --pp {pp} with an EAGLE-3 draft at start-up, so nothing runs: {said} "
            f"({cited.source}, {cited.source.symbol}; said so from {since}{then}; {after})")


PP_FLAGS = {"sglang": "--pp-size", "vllm": "--pipeline-parallel-size"}  # each engine's own option


def pp_refusal(ask: PipelineAsk, server: str | None, cfg: ModelConfig) -> Finding | None:
    """The engine's own refusal of this --pp at start-up: what it raises (with the profile and version), its
    source, the fix (None: it serves it)."""
    if ask.size == 1 or server is None:
        return None
    profile = lookup(server, cfg.model_type)
    said = startup_refusal(profile, ask.size, cfg.family.model_types.get(cfg.model_type, cfg.model_type))
    if said is None:
        return None
    launches = next((q for q in later_profiles(profile) if q.behaviour.pp is not None
                     and q.behaviour.pp.value is not Handoff.REFUSED), None)
    flag = PP_FLAGS.get(profile.engine, "without pipeline parallelism")
    fix = f"serve it with {flag} 1" + (f", or with {launches.name}, which launches it" if launches else "")
    return Finding(Kind.ENGINE_REFUSES, f"pipeline parallel: {said}", [str(profile.behaviour.pp.source)], fix)


def pp_replay(pipe: Pipeline | None, server: str | None, res: Resolution, cfg: ModelConfig) -> None:
    """Under a profile whose stages number their layers from 0, what the last stage captures instead (each
    moved slot a finding in `res`; the stages before the last return early)."""
    if pipe is None or server is None:
        return
    cited = lookup(server, cfg.model_type).behaviour.pp
    if cited is None or cited.value is not Handoff.STAGE_LOCAL:
        return
    last = pipe.stages(cfg.num_hidden_layers, 1)[-1]
    got = []
    for p in res.positions:
        q = numbered_on(p, last)
        if q is not None and q not in got:
            got.append(q)
        if q != p:
            now = f"captures {q}" if q is not None else "matches no layer of it (dropped)"
            res.findings.append(Finding(
                Kind.PIPELINE, f"pipeline parallel: {p} is tested on the last stage (layers {last.start}.."
                f"{last.end - 1}), which numbers its layers from 0, and {now}; the stages before it return early "
                f"({res.convention}: {cited.source})", [str(cited.source)],
                "serve with --pp 1, or a version that numbers layers from start_layer (vLLM 0.30.0)"))
    res.positions = got


def graphs_for(ask: GraphsAsk, server: str | None, cfg: ModelConfig, mode: Mode, tokens: int, pp: int) -> CudaGraphs | None:
    """The CudaGraphs asked for (None without --cuda-graph), checked against the run."""
    ids, size = ask.ids, ask.tokens
    if not ask.on:
        for option, value in (("--graph-ids", ids), ("--graph-tokens", size)):
            if value is not None:
                raise UsageError(f"{option} applies with --cuda-graph; add --cuda-graph or drop {option}")
        return None
    what = f"--pp {pp}" if pp > 1 else mode.graphs_refusal()
    if what is not None:
        raise UsageError(f"--cuda-graph runs without {what} (a graphed batch of every rank's tokens); drop one of them")
    n = DEFAULT_GRAPH_TOKENS if size is None else size
    if not 1 <= n < tokens:
        raise UsageError(f"--graph-tokens {n} must be at least 1 and fewer than the {tokens} tokens run (the eager "
                         f"batch); pass --seq-len {n + 1} or more, or a smaller --graph-tokens")
    L = cfg.num_hidden_layers
    if server is None:
        if ids is not None and ids not in GRAPH_IDS:
            raise UsageError(f"unknown --graph-ids {ids!r}; use one of {', '.join(GRAPH_IDS)}")
        order = GRAPH_IDS[ids or "config"]
        engine = lookup("sglang", cfg.model_type)  # whose default ids a DEFAULT order captures
        return CudaGraphs(order, n, tuple(replay(engine, None, L).positions),
                          f"--graph-ids {ids or 'config'}: {order.value} (default ids: {engine.name}'s)")
    if ids is not None:
        raise UsageError(f"--server {server} decides what its graphs capture (its start-up order); drop --graph-ids")
    profile = lookup(server, cfg.model_type)
    g = profile.behaviour.graphs
    if g is None:
        raise UsageError(f"--server {server}: {profile.name} has no CUDA-graph path (a trainer); drop --cuda-graph")
    return CudaGraphs(g.value, n, tuple(replay(profile, None, L).positions),
                      f"{profile.name}: {g.value.value} ({g.source})")
