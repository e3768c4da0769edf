"""What triage and acceptance read from argv about the two programs: the engine as served (its profile and
flags) and what trained the draft (`--train`)."""

from __future__ import annotations

import re

from tpsim.app.triage import Trained
from tpsim.cli.options import positive_int
from tpsim.cli.parser import refuse_without
from tpsim.config.model import ModelConfig
from tpsim.profiles.conventions import default_ids, parse_convention_ids, refuse_convention_as_profile
from tpsim.profiles.profile import Gpu, Profile, Served
from tpsim.profiles.registry import for_target, lookup

IDS = re.compile(r"default|-?\d+(\s*,\s*-?\d+)*")  # --train NAME:IDS, not ENGINE:MODEL

SGLANG_FLAGS = {"enable_dp_attention": "--enable-dp-attention", "moe_a2a_backend": "--moe-a2a-backend",
                "enable_flashinfer_allreduce_fusion": "--enable-flashinfer-allreduce-fusion"}


def engines_from(args, cfg: ModelConfig, tp: int) -> tuple[Profile, Trained, Served]:
    """--server's profile for the target's model file, --train, and the served flags at TP=tp."""
    serve = for_target(args.server, cfg.model_type)
    trained = trained_from(args.train, cfg.model_type, cfg.num_hidden_layers)
    refuse_without(args, "an SGLang --server", serve.engine == "sglang", SGLANG_FLAGS)  # another engine's flags differ
    served = Served(tp, Gpu(args.gpu), positive_int(args.nnodes, "--nnodes"), args.enable_dp_attention,
                    args.moe_a2a_backend == "deepep", args.enable_flashinfer_allreduce_fusion,
                    not args.disable_cuda_graph, positive_int(getattr(args, "seq_len", None) or "16", "--seq-len"))
    return serve, trained, served


def trained_from(text: str, model_type: str, L: int) -> Trained:
    """--train: CONVENTION:IDS (the ids training used) or a trainer's PROFILE (it reads the draft config)."""
    name, colon, rest = text.partition(":")
    if colon and IDS.fullmatch(rest.strip()):
        conv, ids = parse_convention_ids(text, "--train")
        if ids is None:
            ids = default_ids(conv, L)
        return Trained(conv.profile, conv, tuple(ids), text)
    return Trained(lookup(refuse_convention_as_profile(text, "--train"), model_type))
