"""What the commands share: the option groups and their value parsers (no torch: `tpsim COMMAND
--help` builds them; what a run does with them is tpsim.cli.run_args)."""

from __future__ import annotations

import argparse
import json
import re

from tpsim.base.errors import UsageError
from tpsim.cli.choices import CONVENTIONS, DP_LOCAL_TOKENS, DP_PADDINGS, EP_OUTPUTS, GGUF_TARGETS, MODES
from tpsim.config.loader import DEFAULT_MODEL, builtin_names

DTYPES = ["auto", "float32", "bfloat16", "float16"]
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "f32": "float32", "half": "float16"}
LIST_EXAMPLES = {"--tp": "1,2,4,8", "--layers": "-1,2,30", "--tokens": "1,2,3"}
DEFAULT_TP = 2  # a run at one degree: the smallest that shards anything
TP_RULE = "default 2, the smallest degree that shards; under torchrun the world size"
SERVED_TP_RULE = "default 1, as an engine serves unless told; under torchrun the world size"
# ASCII digits only, as a --prompts file's ids: int() also takes "1_0" and non-ASCII digits ("٣"), near-misses more
# likely typos than counts
ASCII_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*")


# --- option values -------------------------------------------------------------------------

def integer(text: str, option: str, low: int | None = None, example: str = "") -> int:
    try:
        if isinstance(text, str) and not ASCII_INTEGER.fullmatch(text):
            raise ValueError(text)
        v = int(text)
    except ValueError:
        raise UsageError(f"{option} {text!r} is not an integer{example}") from None
    if low is not None and v < low:
        raise UsageError(f"{option} {v} must be at least {low}")
    return v


def convention_option(text: str):
    """--convention's value: a Convention (a profile's name, e.g. `sglang`, is refused with the convention's).
    tpsim.profiles.conventions, and torch with it, is imported once a value is given, not for --help."""
    from tpsim.profiles.conventions import check_convention
    return check_convention(text, "--convention")


CONVENTION_METAVAR = "{" + ",".join(CONVENTIONS) + "}"


def server_option(text: str) -> str:
    """--server's value: a profile (a convention's name, e.g. `sglang-ids`, is refused with the profile's;
    imported as convention_option's is)."""
    from tpsim.profiles.conventions import refuse_convention_as_profile
    return refuse_convention_as_profile(text, "--server")


def positive_int(text: str, option: str) -> int:
    return integer(text, option, low=1)


def optional_int(text: str | None, option: str, low: int) -> int | None:
    return None if text is None else integer(text, option, low)


def seed_value(text: str) -> int:
    """--seed: an integer in [0, 2**63) (the generators take 64-bit seeds)."""
    v = integer(text, "--seed", example=", e.g. --seed 0")
    if not 0 <= v < 2**63:
        raise UsageError(f"--seed {v} is out of range; use 0 <= seed < 2**63")
    return v


def int_list(text: str, option: str) -> list[int]:
    try:
        return [integer(x, option) for x in text.split(",")]
    except UsageError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of integers, "
                         f"e.g. {LIST_EXAMPLES.get(option, '1,2,3')}") from None


def add_json(p: argparse.ArgumentParser, summary: bool = False) -> None:
    """--json: the last option every command with a report adds; `summary`: with --summary, one or the other."""
    g = p.add_mutually_exclusive_group() if summary else p
    g.add_argument("--json", action="store_true", help="print the report as JSON on stdout (and write no other file)")
    if summary:
        g.add_argument("--summary", action="store_true",
                       help="print one line on stdout, the verdict with what a CI job greps for (finding kinds, the "
                            "plan), and nothing else; the exit code is the full report's")


def dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# --- the options every model-running command takes -----------------------------------------

def add_override(p: argparse.ArgumentParser) -> None:
    p.add_argument("--override", action="append", metavar="FIELD=VALUE",
                   help="change one config field, e.g. --override num_hidden_layers=4 (repeatable)")


def add_run_options(p: argparse.ArgumentParser) -> None:
    add_model_option(p)
    p.add_argument("--layers", help="layer ids in the convention's numbering, e.g. --layers -1,2,30 "
                                    "(default: the convention's default ids)")
    p.add_argument("--convention", type=convention_option, metavar=CONVENTION_METAVAR,
                   help="how --layers numbers the layers: an engine's or trainer's own numbering, idealised "
                        "(default sglang-ids; tpsim resolve shows each; --server replays a real engine version)")
    add_server_option(p, draft=True)
    add_execution_options(p)


def add_model_option(p: argparse.ArgumentParser, help: str = "") -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=help or f"the target: a built-in name ({', '.join([*builtin_names(), *GGUF_TARGETS])}), a YAML/JSON "
                                "config with a Hugging Face config.json's fields, or an HF model directory "
                                "(default tiny)")


def add_server_option(p: argparse.ArgumentParser, draft: bool = False, repeat: bool = False) -> None:
    p.add_argument("--server", metavar="PROFILE", type=server_option, action="append" if repeat else "store",
                   help="replay a named engine version: ENGINE[@VERSION][:MODEL], e.g. sglang@0.5.12:deepseek_v2 "
                        "or vllm (tpsim profiles lists them; default version: the latest known, model: --model's)"
                        + ("; repeated: each one a configuration measured in one run, as --sweep's lines" if repeat
                           else ""))
    if draft:
        p.add_argument("--draft-config", metavar="PATH",
                       help="with --server: take the ids from the draft's config.json as that engine reads it")


EXECUTION_OPTIONS = {"dtype": "--dtype", "seq_len": "--seq-len", "seed": "--seed", "device": "--device",
                     "backend": "--backend", "timeout": "--timeout", "ignore_limits": "--ignore-limits",
                     "override": "--override", "weights": "--weights", "compile": "--compile"}


def add_execution_options(p: argparse.ArgumentParser) -> None:
    """How a model runs: dtype, tokens, seed, device, backend, timeout, --ignore-limits, --override."""
    p.add_argument("--dtype", default="auto", type=dtype_name, choices=DTYPES,
                   help="auto: float32 on CPU, bfloat16 on CUDA (bf16, fp16, fp32 also accepted)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp8", "bf16"],
                   help="linear weights kept in block-scaled fp8 (multiplied by a block-scaled fp8 GEMM, "
                        "activations quantized per token and 128 columns) or in the model dtype (bf16: an fp8 "
                        "checkpoint dequantized on load); auto: fp8 for an fp8 checkpoint on CUDA, else bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the memory-bound pieces of each layer (add + RMSNorm, RoPE, silu * up) as "
                        "torch.compile'd kernels (default: on with --device cuda, off on the CPU)")
    p.add_argument("--seq-len", help="number of random tokens drawn from --seed (default 16)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and token seed (default 0)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the ranks run: cpu (gloo, one process per rank) or cuda (one GPU per rank)")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on CUDA, gloo on CPU")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds (default 60)")
    p.add_argument("--ignore-limits", action="store_true",
                   help="run even where the guards say this machine should not (more CPU ranks than cores, "
                        "more memory than is free, an acceptance measurement estimated past 30 minutes)")
    add_override(p)


def add_mode_options(p: argparse.ArgumentParser, strategy: bool = True) -> None:
    p.add_argument("--mode", default="tp", metavar="{" + ",".join(MODES) + "}",
                   help="communication mode of the engine replayed (default tp; docs/modes.md: one section per mode)")
    if strategy:
        p.add_argument("--strategy", help="capture strategy (default: the right one for the mode; tp: model-level, "
                                          "ar-fusion: in-layer, sp/ep/cp: gathered, dp-attention: local; "
                                          "in-layer-uncloned replays in-place aliasing)")
    p.add_argument("--fusion-max-tokens", help="ar-fusion: fuse the MLP all-reduce into the next layer's norm "
                                               "only for batches of at most this many tokens (default 2048)")
    p.add_argument("--ep-output", metavar="{" + ",".join(EP_OUTPUTS) + "}",
                   help="ep: keep the stream token-scattered after MoE layers (scattered, default: SGLang's "
                        "DeepEP path) or all-gather the MoE output (replicated, matches no SGLang path)")
    p.add_argument("--dp-padding", metavar="{" + ",".join(DP_PADDINGS) + "}",
                   help="dp-attention: how the MLP/MoE input is gathered over the ranks, SGLang's DpPaddingMode: "
                        "sum-len (default: SGLang's choice for a prefill batch; all-reduce of a zero buffer of every "
                        "rank's rows, output all-reduced) or max-len (rows padded to the longest rank, all-gather, "
                        "output reduce-scattered; SGLang's CUDA-graph decode default)")
    p.add_argument("--dp-local-tokens", metavar="{" + ",".join(DP_LOCAL_TOKENS) + "}",
                   help="dp-attention, sum-len: how many of its rows each rank places in the MLP gather (SGLang's "
                        "dp_local_num_tokens): all (default, right) or per-request (one per request, the rank's "
                        "logprob count: the metadata error of sglang issue #16274, fixed by PR #16310)")
    p.add_argument("--tbo", action="store_true",
                   help="SGLang's --enable-two-batch-overlap (tp only, DeepSeek-family MoE models): layers from "
                        "first_k_dense_replace on run as two micro-batches, outside the engine's capture loop "
                        "(--strategy micro-batches: the fix of sglang PR #32680)")
    p.add_argument("--enable-dp-lm-head", action="store_true", default=None,
                   help="dp-attention: SGLang's --enable-dp-lm-head, the LM head replicated on each rank's own "
                        "tokens (default off, as in SGLang: vocab-parallel over all ranks' gathered tokens)")


def layer_ids(args) -> list[int] | None:
    return None if args.layers is None else int_list(args.layers, "--layers")


def add_tp(p: argparse.ArgumentParser, what: str = "TP degree") -> None:
    p.add_argument("--tp", help=f"{what} ({TP_RULE})")


def add_served_tp(p: argparse.ArgumentParser, what: str = "TP degree the engine serves at") -> None:
    p.add_argument("--tp", help=f"{what} ({SERVED_TP_RULE})")
