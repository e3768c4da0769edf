"""The parts of a request that triage, acceptance, observe and draft share, typed: the engine as served (`EngineAsk`:
--server's flags as `Served`, --train), the prompts acceptance is measured on (`PromptsAsk`), a draft named by path
or built-in name (`draft_path`), and what tpsim assumed for the user (`assumptions`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpsim.app.acceptance import builtin_prompts, seeded_prompts
from tpsim.app.prompts import Prompts
from tpsim.app.bounds import check_count
from tpsim.app.prompts import check_prompts, read_prompts
from tpsim.app.target import Target
from tpsim.app.triage import Trained
from tpsim.base.errors import UsageError
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.config.model import ModelConfig
from tpsim.profiles.conventions import (Convention, default_ids, parse_convention_ids, refuse_convention_as_profile,
                                       resolve)
from tpsim.profiles.fingerprints import taken_as
from tpsim.profiles.profile import Profile, Served
from tpsim.profiles.registry import for_target, lookup
from tpsim.profiles.vllm import assumed

IDS = re.compile(r"default|-?\d+(\s*,\s*-?\d+)*")  # --train NAME:IDS, not ENGINE:MODEL
CONVENTIONS = {c.value for c in Convention}


@dataclass(frozen=True)
class EngineAsk:
    """The engine as served: `served` (its flags, the served TP, --server as given) and what trained the draft;
    `sglang_only`/`vllm_only`: flags given that only that engine has (refused for the other)."""

    served: Served
    train: str = "specforge"
    sglang_only: tuple[str, ...] = ()
    vllm_only: tuple[str, ...] = ()

    def engines(self, cfg: ModelConfig, server: str) -> tuple[Profile, Trained, Served]:
        """`server`'s profile for the target's model file (`server`: the one that replays --server), --train read
        for it, and the served flags."""
        serve = for_target(server, cfg.model_type)
        trained = trained_from(self.train, cfg.model_type, cfg.num_hidden_layers)
        for engine, needed, flags in (("sglang", "an SGLang --server", self.sglang_only),
                                      ("vllm", "a vLLM --server", self.vllm_only)):
            if flags and serve.engine != engine:
                raise UsageError(f"{flags[0]} applies only with {needed}; add {needed}, or leave {flags[0]} out")
        return serve, trained, self.served

    def assumptions(self, serve: Profile, server: str, model_type: str) -> list[str]:
        """What tpsim assumed replaying `server` (the --server whose model file replays the capture) as `serve`."""
        return assumptions(serve, server, self.train, model_type)


@dataclass(frozen=True)
class PromptsAsk:
    """--prompts (None: the target's built-in prompts with their answers, else `seeded` random ones), --new-tokens."""

    path: str | None = None
    new_tokens: int = 48
    seed: int = 0
    seeded: int = 8

    def __post_init__(self) -> None:
        check_count(self.new_tokens, "--new-tokens")

    def prompts(self, target: Target) -> Prompts:
        """The prompts, every id in the target's vocabulary and every sequence within its context."""
        got = self._read(target)
        check_prompts(got, target.real, target.name, got.origin if self.path is None else f"--prompts {self.path}")
        return got

    def _read(self, target: Target) -> Prompts:
        if self.path is not None:
            return read_prompts(Path(self.path), self.new_tokens)
        builtin = builtin_prompts(target.name)
        if builtin is not None:
            return read_prompts(builtin, self.new_tokens)
        return seeded_prompts(target.real.vocab_size, self.seeded, 16, self.new_tokens, self.seed)


def assumptions(serve: Profile, server: str, train: str, model_type: str) -> list[str]:
    """Every choice tpsim made for the user about where and what: the runner (vLLM), the version taken for an
    engine named without one, a release replayed as a profile whose code was never read (UNVERIFIED)."""
    runner = assumed(serve)
    taken = [taken_as("--server", server, model_type), taken_as("--train", train, model_type)]
    return [a for a in (runner, *taken) if a is not None]


def trained_from(text: str, model_type: str, L: int) -> Trained:
    """--train: CONVENTION:IDS (the ids training used) or a trainer's PROFILE (it reads the draft config)."""
    name, colon, rest = text.partition(":")
    if colon and (IDS.fullmatch(rest.strip()) or name.strip() in CONVENTIONS):
        conv, ids = parse_convention_ids(text, "--train")
        if ids is None:
            ids = default_ids(conv, L)
        try:  # ids no target layer has are bad input, not a finding
            resolve(conv, ids, L)
        except UsageError as e:
            raise UsageError(f"--train {text}: {e}") from None
        return Trained(conv.profile, conv, tuple(ids), text)
    return Trained(lookup(refuse_convention_as_profile(text, "--train"), model_type))


def draft_path(text: str) -> Path:
    """A draft: a directory, a config.json in one, or a built-in draft's name (a directory, or a config alone)."""
    drafts = BUILTIN_CONFIGS / "drafts"
    if not Path(text).exists() and "/" not in text:
        for builtin in (drafts / text, drafts / f"{text.removesuffix('.json')}.json"):
            if builtin.exists():
                return builtin
    return Path(text)
