"""What triage, acceptance and observe read from argv about the engine as served (`EngineAsk`: its flags and
--train) and the prompts acceptance is measured on (`PromptsAsk`)."""

from __future__ import annotations

from tpsim.app.asks import EngineAsk, PromptsAsk
from tpsim.cli.options import positive_int
from tpsim.profiles.profile import Gpu, Served, SpecAlgorithm

SGLANG_FLAGS = {"enable_dp_attention": "--enable-dp-attention", "moe_a2a_backend": "--moe-a2a-backend",
                "enable_flashinfer_allreduce_fusion": "--enable-flashinfer-allreduce-fusion",
                "disable_radix_cache": "--disable-radix-cache", "disaggregation_mode": "--disaggregation-mode"}
VLLM_FLAGS = {"enable_dbo": "--enable-dbo"}


def engine_ask(args, tp: int, given: str) -> EngineAsk:
    """--server's flags at TP=tp (`given`: --server as the user wrote it) and --train."""
    told = getattr(args, "given", ())
    served = Served(tp, Gpu(args.gpu), positive_int(args.nnodes, "--nnodes"), args.enable_dp_attention,
                    args.moe_a2a_backend == "deepep", args.enable_flashinfer_allreduce_fusion,
                    not args.disable_cuda_graph, positive_int(getattr(args, "seq_len", None) or "16", "--seq-len"),
                    not getattr(args, "disable_radix_cache", False),
                    getattr(args, "disaggregation_mode", "null") != "null", getattr(args, "enable_dbo", False), given,
                    SpecAlgorithm(getattr(args, "speculative_algorithm", "EAGLE3")))
    return EngineAsk(served, args.train, tuple(o for d, o in SGLANG_FLAGS.items() if d in told),
                     tuple(o for d, o in VLLM_FLAGS.items() if d in told))


def prompts_ask(args) -> PromptsAsk:
    return PromptsAsk(args.prompts, positive_int(args.new_tokens, "--new-tokens"), args.seed)
