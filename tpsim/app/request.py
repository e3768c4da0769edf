"""A run as asked for, typed and argparse-free: `RunRequest(...).spec()` checks every option
against the config, the mode, the degrees and the machine before any rank starts, and returns the
RunSpec the ranks receive (UsageError, one line, on the first thing that cannot run).

    from tpsim.app.request import RunRequest
    from tpsim.modes import ArFusion
    spec, resolution = RunRequest(tps=(1, 2), mode=ArFusion(), strategy="model-level").spec()
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpsim.app.preflight import check_memory, check_timeout, check_world
from tpsim.app.run_options import GraphsAsk, PipelineAsk, graphs_for, pipeline_for, pp_refusal, pp_replay
from tpsim.base.errors import UsageError
from tpsim.capture import Position, PositionKind
from tpsim.profiles.conventions import Convention, resolve
from tpsim.profiles.resolution import Resolution, resolution
from tpsim.config.loader import ModelConfig
from tpsim.modes import Mode, Strategy, TensorParallel
from tpsim.offline.align import read_draft_config
from tpsim.profiles.draft import read_ids
from tpsim.profiles.findings import Finding, Kind, replay_findings
from tpsim.profiles.fingerprints import unverified
from tpsim.profiles.history import model_file_server
from tpsim.profiles.prefix import prefix_hit
from tpsim.profiles.profile import TboCapture
from tpsim.profiles.registry import for_target
from tpsim.profiles.replay import UNPACK_TEXT, replay
from tpsim.run.spec import DEFAULT_MODEL, ModelSource, RunSpec, check_tokens, input_ids_for

MAX_TOKENS = 2**20  # far beyond any real context here (V3: 163840); keeps a typo from allocating 8 TB of ids
DEFAULT_SEQ_LEN = 16


@dataclass(frozen=True)
class Ids:
    """Which positions to capture, as the user names them: ids in a convention's numbering, or as a
    --server profile's engine reads them (from `layers` or the draft's config.json)."""

    layers: tuple[int, ...] | None = None
    convention: Convention | None = None
    server: str | None = None
    draft_config: str | None = None


@dataclass(frozen=True)
class RunRequest:
    """Everything a model-running command asks for. `weights` None: the command has no --weights
    (the config's weights as they are); `strategy` None: the mode's right one."""

    model: str = DEFAULT_MODEL
    overrides: tuple[str, ...] = ()
    tps: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    dtype: str = "auto"
    weights: str | None = None
    compile: bool | None = None
    device: str = "cpu"
    backend: str | None = None
    timeout: float = 60.0
    ignore_limits: bool = False
    tokens: tuple[int, ...] | None = None
    seq_len: int | None = None
    ids: Ids = Ids()
    mode: Mode = TensorParallel()
    strategy: str | None = None
    tbo_asked: bool = False  # --tbo: said in the notes of a --server resolution
    pipeline: PipelineAsk = PipelineAsk()
    graphs: GraphsAsk = GraphsAsk()
    prefix_cached: int | None = None  # --prefix-cached N: the prompt shares its first N tokens with a cached request

    @property
    def run_dtype(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.dtype

    def source(self) -> ModelSource:
        """--model with --override, checked at every degree the run shards over (none under cp)."""
        return ModelSource.load(self.model, list(self.overrides), [] if self.mode.whole_weights else list(self.tps))

    def spec(self, source: ModelSource | None = None, positions: tuple[Position, ...] | None = None,
             decided: tuple[Mode, Strategy] | None = None) -> tuple[RunSpec, Resolution | None]:
        """The RunSpec, everything checked (`positions`, `decided`: the capture and the mode with its
        strategy when the caller decided them, else this request's ids and mode)."""
        check_timeout(self.timeout)
        src = source or self.source()
        if self.weights is not None:
            src = weights_for(self.weights, self.device, src, list(self.tps))
        hit, ids, replayed_as = None, self.ids, None
        if self.prefix_cached is not None:  # an SGLang version before the model files' range: 0.5.6's loop captures
            hit = prefix_hit(self.ids.server, self.prefix_cached)
            server, replayed_as = model_file_server(self.ids.server or "sglang", "the radix cache")
            ids = dataclasses.replace(self.ids, server=server) if self.ids.server else self.ids
        res = resolution_for(ids, src.cfg, self.tbo_asked) if positions is None else None
        if res is not None and replayed_as:
            res.notes.append(replayed_as)
        tokens = tokens_for(self.tokens, self.seq_len, self.seed, src.cfg)
        mode, strategy = decided or (self.mode, self.mode.strategy(self.strategy))
        for t in self.tps:
            mode.check(src.cfg, t, len(tokens))
        refused = pp_refusal(self.pipeline, self.ids.server, src.cfg)
        if refused is not None and res is not None:  # the engine stops at start-up: nothing runs
            res.findings, res.failed = [refused], True
        pipe = pipeline_for(self.pipeline, self.ids.server, src.cfg, list(self.tps), mode)
        if res is not None:
            pp_replay(pipe, self.ids.server, res, src.cfg)
        graphs = graphs_for(self.graphs, self.ids.server, src.cfg, mode, len(tokens), pipe.size if pipe else 1)
        tps = list(self.tps)
        if pipe is None:
            check_world(max(tps), self.device, self.ignore_limits)
        else:
            check_world(pipe.size * max(tps), self.device, self.ignore_limits, f"--pp {pipe.size} x --tp {max(tps)}")
        dtype = self.run_dtype
        check_memory(src.cfg, tps, dtype, self.device, self.ignore_limits, str(self.model), mode.whole_weights)
        compiled = self.device == "cuda" if self.compile is None else self.compile
        spec = RunSpec(src, self.seed, dtype, tuple(tokens), tuple(res.positions if positions is None else positions),
                       mode, strategy, self.device, self.backend, self.timeout, pipe, graphs, compiled, hit)
        return spec, res


def weights_for(weights: str, device: str, src: ModelSource, tps: list[int]) -> ModelSource:
    """The source with its config saying how linear weights are kept (ModelConfig.fp8_block)."""
    quant = src.cfg.extra.get("quantization_config") or {}
    fp8 = weights == "fp8" or (weights == "auto" and device == "cuda" and src.checkpoint is not None
                               and quant.get("quant_method") == "fp8")
    if not fp8:
        return src
    if src.cfg.family.sinks:
        raise UsageError(f"--weights fp8 covers the DeepSeek, Llama and Qwen families; {src.cfg.model_type} "
                         "publishes mxfp4 experts: use --weights bf16")
    src = dataclasses.replace(src, cfg=dataclasses.replace(src.cfg, fp8_block=src.cfg.weight_block()))
    for t in tps:
        src.cfg.check_fp8(t)
    return src


def tokens_for(tokens: tuple[int, ...] | None, seq_len: int | None, seed: int, cfg: ModelConfig) -> list[int]:
    """The token ids the run feeds: --tokens as given, else --seq-len ids drawn from the seed."""
    if tokens is not None:
        if seq_len is not None:
            raise UsageError("--tokens and --seq-len both say which tokens to run; give one of them")
        check_tokens(tokens, cfg)
        return list(tokens)
    n = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if n > MAX_TOKENS:
        raise UsageError(f"--seq-len {n} is more tokens than tpsim runs (at most {MAX_TOKENS})")
    if n > cfg.max_position_embeddings:
        raise UsageError(f"--seq-len {n} exceeds max_position_embeddings={cfg.max_position_embeddings}")
    return input_ids_for(cfg, seed, n)


def resolution_for(ids: Ids, cfg: ModelConfig, tbo: bool = False) -> Resolution:
    """The ids in their convention's numbering, or as the --server profile's engine handles them."""
    layers, L = None if ids.layers is None else list(ids.layers), cfg.num_hidden_layers
    if ids.server is None:
        if ids.draft_config is not None:
            raise UsageError("--draft-config is read as an engine reads it: give --server PROFILE too")
        return resolve(ids.convention or Convention.SGLANG, layers, L)
    if ids.convention is not None:
        raise UsageError("--server and --convention both say how ids are numbered; give one of them")
    profile = for_target(ids.server, cfg.model_type)
    stale = unverified(ids.server, cfg.model_type)
    notes = [f"--server {ids.server}: profile {profile.name} ({profile.versions.text()})"]
    if tbo:
        notes.append(tbo_note(profile))
    if ids.draft_config is not None:
        if layers is not None:
            raise UsageError("--layers and --draft-config both give the ids; give one of them")
        got = read_ids(profile, read_draft_config(ids.draft_config).raw)
        if got.failure:
            off = Finding(Kind.CAPTURE_OFF, got.failure, [str(profile.behaviour.config.source)], None)
            return Resolution(profile.name, L, None, [], "internal_ids", [], notes, [off], True, stale)
        layers = got.ids
        notes.append(f"{ids.draft_config}: falls back to the default: {got.fallback}" if got.fallback else
                     f"{ids.draft_config}: ids {layers} from {got.where}" if layers is not None else
                     f"{ids.draft_config}: no ids: the default")
    rep = replay(profile, layers, L)
    res = resolution(rep, layers)
    if tbo:
        notes += tbo_failure(rep, cfg.first_k_dense_replace)
    res.notes[:0] = notes
    res.findings, res.failed = replay_findings(rep, cfg.hidden_size), rep.crashed or rep.refused
    res.unverified = stale
    return res


def tbo_failure(rep, first_k: int) -> list[str]:
    """Under two-batch overlap, what a packing engine (TboCapture.REGION_FAILS) says when the TBO region
    holds some of its slots (the engine's own text, [] when it does not fail)."""
    tbo = rep.profile.behaviour.tbo
    if tbo is None or tbo.value is not TboCapture.REGION_FAILS:
        return []
    n, got = len(rep.slots), sum(p.kind is not PositionKind.FINAL and p.boundary < first_k for p in rep.positions)
    if got == n:
        return []
    said = tbo.error.format(i=got, n=n) if got else UNPACK_TEXT
    return [f"under two-batch overlap {rep.profile.name} fails the forward: {said} ({got} of {n} slots lie before "
            f"first_k_dense_replace = {first_k}; {tbo.source})"]


def tbo_note(profile) -> str:
    """--tbo with --server: what the profile's capture does under two-batch overlap (UsageError when
    its engine has none)."""
    tbo = profile.behaviour.tbo
    if tbo is None:
        raise UsageError(f"--tbo replays SGLang's --enable-two-batch-overlap; profile {profile.name} has no "
                         "two-batch overlap (tpsim profiles it for sglang's DeepSeek model file only)")
    return f"two-batch overlap in {profile.name}: {tbo.value.value} ({tbo.source})"
