"""What triage and acceptance read from argv: the engine as served (its profile and flags), what trained the
draft (`--train`), the draft (`--draft`) and the prompts acceptance is measured on."""

from __future__ import annotations

import re
from pathlib import Path

from tpsim.app.triage import Trained
from tpsim.cli.options import positive_int
from tpsim.app.acceptance import Prompts, builtin_prompts, read_prompts, seeded_prompts
from tpsim.app.target import Target
from tpsim.cli.parser import refuse_without
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.config.model import ModelConfig
from tpsim.profiles.conventions import default_ids, parse_convention_ids, refuse_convention_as_profile
from tpsim.profiles.profile import Gpu, Profile, Served
from tpsim.profiles.fingerprints import taken_as
from tpsim.profiles.registry import for_target, lookup
from tpsim.profiles.vllm import assumed

IDS = re.compile(r"default|-?\d+(\s*,\s*-?\d+)*")  # --train NAME:IDS, not ENGINE:MODEL

SGLANG_FLAGS = {"enable_dp_attention": "--enable-dp-attention", "moe_a2a_backend": "--moe-a2a-backend",
                "enable_flashinfer_allreduce_fusion": "--enable-flashinfer-allreduce-fusion",
                "disable_radix_cache": "--disable-radix-cache", "disaggregation_mode": "--disaggregation-mode"}


def engines_from(args, cfg: ModelConfig, tp: int, given: str | None = None) -> tuple[Profile, Trained, Served]:
    """--server's profile for the target's model file, --train, and the served flags at TP=tp (`given`: --server as
    the user wrote it, where args.server names the model file that replays it: history.model_file_server)."""
    serve = for_target(args.server, cfg.model_type)
    trained = trained_from(args.train, cfg.model_type, cfg.num_hidden_layers)
    refuse_without(args, "an SGLang --server", serve.engine == "sglang", SGLANG_FLAGS)  # another engine's flags differ
    refuse_without(args, "a vLLM --server", serve.engine == "vllm", {"enable_dbo": "--enable-dbo"})
    served = Served(tp, Gpu(args.gpu), positive_int(args.nnodes, "--nnodes"), args.enable_dp_attention,
                    args.moe_a2a_backend == "deepep", args.enable_flashinfer_allreduce_fusion,
                    not args.disable_cuda_graph, positive_int(getattr(args, "seq_len", None) or "16", "--seq-len"),
                    not getattr(args, "disable_radix_cache", False),
                    getattr(args, "disaggregation_mode", "null") != "null", getattr(args, "enable_dbo", False),
                    given or args.server)
    return serve, trained, served


def assumptions(serve: Profile, server: str, train: str, model_type: str) -> list[str]:
    """Every choice tpsim made for the user about where and what: the runner (vLLM), the version taken for an
    engine named without one, a release replayed as a profile whose code was never read (UNVERIFIED)."""
    runner = assumed(serve)
    taken = [taken_as("--server", server, model_type), taken_as("--train", train, model_type)]
    return [a for a in (runner, *taken) if a is not None]


def trained_from(text: str, model_type: str, L: int) -> Trained:
    """--train: CONVENTION:IDS (the ids training used) or a trainer's PROFILE (it reads the draft config)."""
    name, colon, rest = text.partition(":")
    if colon and IDS.fullmatch(rest.strip()):
        conv, ids = parse_convention_ids(text, "--train")
        if ids is None:
            ids = default_ids(conv, L)
        return Trained(conv.profile, conv, tuple(ids), text)
    return Trained(lookup(refuse_convention_as_profile(text, "--train"), model_type))


def draft_dir(text: str) -> Path:
    """--draft: a directory, a config.json in one, or a built-in draft's name (a directory, or a config alone)."""
    drafts = BUILTIN_CONFIGS / "drafts"
    if not Path(text).exists() and "/" not in text:
        for builtin in (drafts / text, drafts / f"{text.removesuffix('.json')}.json"):
            if builtin.exists():
                return builtin
    return Path(text)


def prompts_from(args, target: Target) -> Prompts:
    """--prompts, else the target's built-in prompts with their answers, else 8 seeded random prompts."""
    new_tokens = positive_int(args.new_tokens, "--new-tokens")
    if args.prompts is not None:
        return read_prompts(Path(args.prompts), new_tokens)
    builtin = builtin_prompts(target.name)
    if builtin is not None:
        return read_prompts(builtin, new_tokens)
    return seeded_prompts(target.real.vocab_size, 8, 16, new_tokens, args.seed)
