"""The run contract: what a command asks the ranks to run, built and validated once, in the
command, and handed to every rank as is (picklable; the torchrun path and the self-spawned
pool take the same object)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpsim.base.errors import UsageError
from tpsim.capture import Position
from tpsim.weights.gguf_builtin import GGUF_TARGETS, checkpoint_dir
from tpsim.weights.reader import Checkpoint, validate
from tpsim.config.loader import BUILTIN_CONFIGS, ModelConfig, load_config, with_overrides
from tpsim.config.loader import DEFAULT_MODEL  # noqa: F401  (defined with the built-in names; imported from here too)
from tpsim.modes import Mode, Strategy, TensorParallel
from tpsim.profiles.prefix import PrefixHit
from tpsim.run.graphs import CudaGraphs
from tpsim.run.pipeline import Pipeline

TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 1e-2}  # ‖TP=t − TP=1‖ / ‖TP=1‖
DEVICES = ("cpu", "cuda")


def model_path(text: str) -> Path:
    """--model as a path: a file or directory as given, else a built-in config by name, else a
    built-in GGUF target (smollm2-135m) as the checkpoint directory converted from it."""
    p = Path(text)
    if not p.exists():
        if text in GGUF_TARGETS:
            return checkpoint_dir(text)
        for cand in (BUILTIN_CONFIGS / text, BUILTIN_CONFIGS / f"{text}.yaml"):
            if cand.is_file():
                return cand
    return p


@dataclass(frozen=True)
class ModelSource:
    """What --model names: its config (with --override applied) and, for an HF directory, the
    validated checkpoint the ranks will read (`notes` say what it holds beyond the config)."""

    name: str
    cfg: ModelConfig
    checkpoint: Path | None = None
    fingerprint: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def weights(self) -> str:
        return f"checkpoint {self.checkpoint}" if self.checkpoint else "seeded random"

    def reads(self) -> list[Path]:
        """The files this source is read from (the config; every file of a checkpoint directory)."""
        if self.checkpoint is not None:
            return [f.resolve() for f in self.checkpoint.iterdir() if f.is_file()]
        p = model_path(self.name)
        return [p.resolve()] if p.is_file() else []

    @classmethod
    def load(cls, model: str, overrides: list[str], tps: list[int]) -> "ModelSource":
        p = model_path(model)
        cfg = with_overrides(load_config(p), overrides)
        for t in tps:
            cfg.check_tp(t)
        if not p.is_dir():
            return cls(model, cfg)
        ckpt = Checkpoint(p)
        return cls(model, cfg, p.resolve(), ckpt.fingerprint(), tuple(validate(ckpt, cfg)))


def input_ids_for(cfg: ModelConfig, seed: int, seq_len: int) -> list[int]:
    """Random token ids drawn from `seed` (the same on every rank and every run)."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.randint(0, cfg.vocab_size, (seq_len,), generator=g).tolist()


def check_tokens(tokens, cfg: ModelConfig) -> None:
    """Token ids a model can run: at most max_position_embeddings of them, each in the vocabulary."""
    if len(tokens) > cfg.max_position_embeddings:
        raise UsageError(f"--tokens gives {len(tokens)} tokens, more than max_position_embeddings="
                         f"{cfg.max_position_embeddings}; pass at most {cfg.max_position_embeddings}")
    bad = next((t for t in tokens if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise UsageError(f"--tokens: id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1} "
                         f"(vocab_size={cfg.vocab_size})")


def check_prefix_cached(spec: "RunSpec") -> None:
    """--prefix-cached N: a cache hit that leaves tokens to run, in a mode and layout that can replay it."""
    n, T = spec.prefix_hit.shared, len(spec.tokens)
    if n < 1:
        raise UsageError(f"--prefix-cached {n} must be at least 1 (the prompt's tokens the radix cache holds); "
                         "drop it for a prefill without a cache hit")
    if n >= T:
        raise UsageError(f"--prefix-cached {n} leaves none of the {T} tokens to run (a prefill runs at least one "
                         f"after the cache hit); use --prefix-cached {T - 1} or less, or more tokens")
    refusal = spec.mode.prefix_cache_refusal(n)
    for option, given in (("--pp", spec.pipeline), ("--cuda-graph", spec.graphs)):
        if refusal is None and given:
            refusal = f"--prefix-cached {n} and {option} together are not replayed; drop one of them"
    if refusal is not None:
        raise UsageError(refusal)


@dataclass(frozen=True)
class RunSpec:
    """One run: the model and its weights, the tokens, what to capture, the mode, where to run."""

    source: ModelSource
    seed: int
    dtype: str
    tokens: tuple[int, ...]
    positions: tuple[Position, ...] = ()
    mode: Mode = field(default_factory=TensorParallel)
    strategy: Strategy = Strategy.MODEL_LEVEL
    device: str = "cpu"
    backend: str | None = None
    timeout_s: float = 60.0
    pipeline: Pipeline | None = None  # --pp > 1
    graphs: CudaGraphs | None = None  # --cuda-graph
    compiled: bool = False  # --compile: the layers call tpsim.layers.fused's compiled kernels
    prefix_hit: PrefixHit | None = None  # --prefix-cached: the prompt shares its first N tokens with a cached request

    def __post_init__(self) -> None:
        """A spec built in Python guards itself as `RunRequest.spec()` guards the CLI's (which checks
        more first: memory, the world, the flags' combinations): the same one-line UsageErrors."""
        if self.dtype not in TOLERANCE:
            raise UsageError(f"dtype {self.dtype!r} is not one of {', '.join(TOLERANCE)}")
        if self.device not in DEVICES:
            raise UsageError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if not self.tokens:
            raise UsageError("a run needs at least one token")
        check_tokens(self.tokens, self.cfg)
        if not 0 < self.timeout_s < float("inf"):
            raise UsageError(f"--timeout {self.timeout_s:g} must be a positive, finite number of seconds")
        L = self.cfg.num_hidden_layers
        outside = next((p for p in self.positions if p.layer is not None and not 0 <= p.layer < L), None)
        if outside is not None:
            raise UsageError(f"position {outside} is outside the model's {L} layers (out(0)..out({L - 1}))")
        refusal = self.pipeline and self.mode.pipeline_refusal(self.pipeline.size)
        if refusal:
            raise UsageError(refusal)
        what = self.graphs and (f"--pp {self.pipeline.size}" if self.pipeline else self.mode.graphs_refusal())
        if what:
            raise UsageError(f"--cuda-graph runs without {what} (a graphed batch of every rank's tokens); drop one "
                             "of them")
        if self.prefix_hit is not None:
            check_prefix_cached(self)

    @property
    def cfg(self) -> ModelConfig:
        return self.source.cfg

    @property
    def prefix_cached(self) -> int | None:
        """The positions a radix-cache hit reuses (None: no hit, or one that reuses none)."""
        return (self.prefix_hit and self.prefix_hit.reused) or None

    @property
    def forward_tokens(self) -> int:
        """The tokens of the captured forward: every one, or those after a cached prefix."""
        return len(self.tokens) - (self.prefix_cached or 0)

    @property
    def tolerance(self) -> float:
        """‖TP=t − TP=1‖ / ‖TP=1‖ allowed: the dtype's, or with fp8 weights the bf16 bound (activations are
        quantized to fp8 per token group, and a different all-reduce order can flip one rounding step)."""
        return TOLERANCE["bfloat16"] if self.cfg.fp8_block is not None else TOLERANCE[self.dtype]

    @property
    def checkpoint(self) -> str | None:
        return None if self.source.checkpoint is None else str(self.source.checkpoint)
