"""The names the options list in --help and take as values, written out here because every module
that defines them imports torch, and --help imports none (tpsim.cli.arguments builds every
command's options from this module). tests/test_help_fast.py holds each copy equal to its source."""

MODES = ("tp", "ar-fusion", "sp", "ep", "dp-attention", "cp")  # tpsim.modes.MODES
EP_OUTPUTS = ("replicated", "scattered")  # tpsim.modes.EP_OUTPUTS
DP_PADDINGS = ("max-len", "sum-len")  # tpsim.modes.DP_PADDINGS
DP_LOCAL_TOKENS = ("all", "per-request")  # tpsim.modes.DP_LOCAL_TOKENS
CONVENTIONS = ("sglang-ids", "sglang-boundary-ids", "vllm-ids", "specforge-ids", "output-of", "hf-ids",
               "eagle-ids")  # tpsim.profiles.conventions.CONVENTIONS
GPUS = ("H100", "H200", "H20", "B200", "GB200", "A100")  # tpsim.profiles.profile.Gpu's values
SPLITS = ("sglang", "vllm")  # tpsim.parallel.pipeline.SPLITS
PP_CAPTURES = ("last-stage", "handoff")  # tpsim.capture.pipeline.PP_CAPTURES
GRAPH_IDS = ("config", "none", "default")  # tpsim.app.run_options.GRAPH_IDS
DEFAULT_GRAPH_TOKENS = 4  # tpsim.app.run_options.DEFAULT_GRAPH_TOKENS
GGUF_TARGETS = ("smollm2-135m",)  # tpsim.weights.gguf_builtin.GGUF_TARGETS' names
