"""Bad input everywhere: one catalogue of every command against every class of bad input, and a
fuzz test that throws arbitrary strings at every option of every command.

The catalogue (`CASES`) runs each case as a real `python -m tpsim` subprocess in a fresh, empty
working directory and requires the bad-input contract of the CLI: exit 2, exactly one stderr line
`tpsim: error: <problem and fix>` holding the expected words, nothing on stdout, no "Traceback",
and nothing written (the working directory stays empty and the shared input files are unchanged).
The subprocesses start once, four at a time, in a module-scoped fixture; each costs a torch import
(about 1.5 s of CPU), so the 82 cases take about 65 s on 2 cores.

The fuzz calls `tpsim.cli.main.run_command(argv)` in process (no subprocess per example). Every base
command line ends in an error that is only checked after all other validation (`--backend nccl`
on the CPU, or an export too large for the disk), so a fuzzed value that happens to be valid
still stops before any rank is spawned or any file is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from clirun import SCRUB, assert_one_line_error, cli_env, run_cli
from tpsim.cli.main import run_command

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
CONVENTIONS = "sglang-ids, sglang-boundary-ids, vllm-ids, specforge-ids, output-of, hf-ids, eagle-ids"
OLD_CONVENTIONS = ["sglang", "sglang-boundary", "vllm", "specforge", "hf", "eagle"]  # profile names: refused
CASE_TIMEOUT_S = 60  # a case that hangs (a FIFO read, a huge loop) fails instead of hanging the suite


# --- input files every case reads (never written to) --------------------------------------------

H, T = 8, 4  # the synthetic rank dumps: hidden 8, 4 tokens


def noise(*shape) -> bytes:
    """Random bytes behind a PNG signature: binary junk where text or tensors are expected."""
    g = torch.Generator().manual_seed(sum(shape))
    return b"\x89PNG\r\n\x1a\n" + bytes(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).tolist())


def rank_dumps(d: Path, stem: str, tp: int, meta: dict | None = None) -> list[Path]:
    """tpsim rank dumps of one replicated point (layers.0.out) at TP=tp."""
    x, paths = torch.arange(T * H, dtype=torch.float32).reshape(T, H), []
    for r in range(tp):
        p = d / f"{stem}.rank{r}.safetensors"
        save_file({"layers.0.out": x.clone(), "input_ids": torch.arange(T)},
                  str(p), {"format": "tpsim-rank-dump", "rank": str(r), "tp": str(tp), "points": "layers.0.out",
                           "placement.layers.0.out": "Replicate()", "position.layers.0.out": "out(0)",
                           **(meta or {})})
        paths.append(p)
    return paths


def write_inputs(d: Path) -> dict[str, Path]:
    f = {}

    def put(name: str, data) -> Path:
        f[name] = d / name
        if isinstance(data, bytes):
            f[name].write_bytes(data)
        else:
            f[name].write_text(data if isinstance(data, str) else json.dumps(data))
        return f[name]

    for ext in ("yaml", "json", "safetensors"):
        put(f"png.{ext}", noise(300))
    put("empty.yaml", "")
    put("empty.safetensors", b"")
    put("deep.json", "[" * 100_000 + "]" * 100_000)  # deeper than json can recurse
    tiny = (Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").read_text()
    put("alias-bomb.yaml", "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n" + tiny)
    put("huge.yaml", tiny.replace("hidden_size: 64", "hidden_size: 1" + "0" * 400))
    put("cfg.yaml", tiny)
    (d / "link.safetensors").symlink_to(d / "cfg.yaml")
    f["link.safetensors"] = d / "link.safetensors"
    os.mkfifo(d / "pf.rank0.safetensors")  # rank 0's dump of --out pf.safetensors
    f["pf.safetensors"] = d / "pf.safetensors"
    f["st"] = d / "st.safetensors"
    save_file({"x": torch.zeros(2, 3)}, str(f["st"]))
    os.mkfifo(d / "fifo")  # opening it to read would block forever: a non-regular file must be refused
    f["fifo"] = d / "fifo"
    for name in ("dir", "dumps", "ckpt_png", "ckpt_fifo", "ckpt_deep_index", "ckpt_bad_entry"):
        f[name] = d / name
        f[name].mkdir()
    # HF checkpoint directories broken in ways test_checkpoint.py does not cover
    for name in ("ckpt_png", "ckpt_fifo", "ckpt_deep_index", "ckpt_bad_entry"):
        (f[name] / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 2}))
    (f["ckpt_png"] / "model.safetensors").write_bytes(noise(400))
    os.mkfifo(f["ckpt_fifo"] / "model.safetensors")
    save_file({"x": torch.zeros(2)}, str(f["ckpt_deep_index"] / "model.safetensors"))
    (f["ckpt_deep_index"] / "model.safetensors.index.json").write_text("{" + '"a":{' * 50_000 + "}" * 50_001)
    header = json.dumps({"x": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}}).encode()
    (f["ckpt_bad_entry"] / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    # model families: configs each refused for one reason
    qwen3 = yaml.safe_load((ROOT / "configs" / "tiny-qwen3.yaml").read_text())
    put("qwen3_no_head_dim.json", {k: v for k, v in qwen3.items() if k != "head_dim"})
    put("llama_mlp_bias.json", {**yaml.safe_load((ROOT / "configs" / "tiny-llama.yaml").read_text()), "mlp_bias": True})
    put("mixtral.json", {"model_type": "mixtral", "hidden_size": 64})
    # align: draft configs
    put("draft_ok.json", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}})
    put("draft_empty_ids.json", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}})
    put("draft_bool_ids.json", {"eagle_aux_hidden_state_layer_ids": [True, 2, 3]})
    put("draft_is_a_target.json", {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                    "num_hidden_layers": 61, "hidden_size": 7168})
    put("draft_off_string.json", {"eagle_config": {"use_aux_hidden_state": "false",
                                                   "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    put("draft_many_ids.json", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2] * 1_000_000}})
    # diagnose: rank dumps, a capture as reference, SGLang dumper files
    f["good"] = rank_dumps(d / "dumps", "good", 2)
    f["hugetp"] = rank_dumps(d / "dumps", "hugetp", 1, {"tp": "99999999999"})
    f["tp0"] = rank_dumps(d / "dumps", "tp0", 1, {"tp": "0"})
    f["ref"] = d / "ref.safetensors"
    save_file({"aux_hidden_states": torch.arange(T * H, dtype=torch.float32).reshape(T, H), "input_ids": torch.arange(T)},
              str(f["ref"]), {"positions": "out(0)"})
    f["ref_1d"] = d / "ref_1d.pt"
    torch.save(torch.zeros(5), f["ref_1d"])
    f["sgl_huge_rank"] = d / "step=0___rank=99999999999___name=x.pt"
    torch.save(torch.zeros(2, 3), f["sgl_huge_rank"])
    f["sgl_pickle"] = d / "step=0___rank=0___name=y.pt"  # a plain pickle: torch warned in two lines, then refused
    f["sgl_pickle"].write_bytes(pickle.dumps({"value": [1, 2]}, protocol=4))
    f["sgl_sup_rank"] = d / "step=0___rank=²___name=x.pt"  # "²".isdigit(), but int("²") fails
    torch.save(torch.zeros(2, 3), f["sgl_sup_rank"])
    f["sgl_png"] = put("step=0___rank=0___name=x.pt", noise(64))
    return f


# --- the catalogue ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # {NAME}: an input file of write_inputs (a list expands to its files); relative paths
    #                        are inside the case's own fresh, empty working directory
    expect: tuple[str, ...]  # substrings of the one error line


def case(id: str, argv: str | list[str], *expect: str) -> Case:
    return Case(id, tuple(argv.split() if isinstance(argv, str) else argv), expect)


SEED_2_70 = str(2**70)
LONG = "n" * 300  # a file name longer than NAME_MAX (255 bytes)
DRAFT = "--server vllm --num-layers 61"
SIDES = "--train specforge-ids:default --serve vllm-ids:default"
CASES = [
    # --- check ---------------------------------------------------------------------------------------
    case("check-tp-malformed-list", "check --tp 1,,2", "--tp '1,,2'", "comma-separated list of integers", "1,2,4,8"),
    # --- communication modes -------------------------------------------------------------------------
    case("mode-unknown", "check --mode dp", "unknown --mode 'dp'", "tp, ar-fusion, sp, ep, dp-attention"),
    case("mode-ep-tp-not-dividing-experts", "check --mode ep --tp 1,4 --override n_routed_experts=6",
         "--mode ep at --tp 4", "n_routed_experts=6", "divides 6"),
    case("mode-strategy-not-of-mode", "check --mode sp --strategy in-layer",
         "capture strategy 'in-layer' does not exist for --mode sp", "gathered, local"),
    case("mode-fusion-max-tokens-zero", "check --mode ar-fusion --fusion-max-tokens 0",
         "--fusion-max-tokens 0 must be at least 1"),
    case("mode-fusion-max-tokens-negative", "capture --mode ar-fusion --fusion-max-tokens=-5 --out c.safetensors",
         "--fusion-max-tokens -5 must be at least 1"),
    case("mode-fusion-max-tokens-without-ar-fusion", "explain --mode sp --fusion-max-tokens 8",
         "--fusion-max-tokens applies to --mode ar-fusion only"),
    case("mode-ep-output-unknown", "check --mode ep --ep-output sideways", "unknown --ep-output 'sideways'",
         "replicated, scattered"),
    case("mode-dp-padding-without-dp-attention", "check --mode tp --dp-padding max-len",
         "--dp-padding applies to --mode dp-attention only, not --mode tp"),
    case("mode-dp-lm-head-without-dp-attention", "capture --mode ep --enable-dp-lm-head --out c.safetensors",
         "--enable-dp-lm-head applies to --mode dp-attention only, not --mode ep"),
    case("mode-dp-lm-head-default-mode", "explain --enable-dp-lm-head", "--enable-dp-lm-head applies to --mode "
         "dp-attention only"),
    case("mode-dp-padding-unknown", "check --mode dp-attention --dp-padding max_len", "unknown --dp-padding 'max_len'",
         "max-len, sum-len"),
    case("mode-dp-local-tokens-unknown", "check --mode dp-attention --dp-local-tokens one",
         "unknown --dp-local-tokens 'one'", "all, per-request"),
    case("mode-dp-local-tokens-max-len", "check --mode dp-attention --dp-local-tokens per-request --dp-padding max-len",
         "--dp-local-tokens per-request replays the sum-len gather", "pass --dp-padding sum-len"),
    case("mode-dp-local-tokens-without-dp-attention", "check --dp-local-tokens per-request",
         "--dp-local-tokens applies to --mode dp-attention only, not --mode tp"),
    case("mode-dp-attention-too-few-tokens", "capture --mode dp-attention --tp 4 --seq-len 2 --out c.safetensors",
         "needs at least 4 tokens, got 2"),
    case("mode-cp-too-few-tokens", "check --mode cp --tp 1,4 --seq-len 3", "--mode cp at --tp 4",
         "needs at least 4 tokens, got 3"),
    case("mode-cp-tbo", "check --mode cp --tbo", "--tbo replays SGLang's two-batch overlap in pure TP only",
         "not --mode cp"),
    case("mode-cp-pp", "check --mode cp --pp 2 --tp 1,2", "--pp 2 runs with --mode tp only, not --mode cp"),
    case("mode-cp-cuda-graph", "check --mode cp --cuda-graph --tp 1,2", "--cuda-graph runs without --mode cp"),
    case("mode-cp-strategy", "check --mode cp --strategy in-layer",
         "capture strategy 'in-layer' does not exist for --mode cp", "gathered, local"),
    # --- two-batch overlap (--tbo) --------------------------------------------------------------------
    case("tbo-model-without-moe", "check --tbo --model tiny-llama", "--tbo needs a DeepSeek-family model with MoE",
         "model_type llama with 0 MoE layers"),
    case("tbo-all-layers-dense", "check --tbo --override first_k_dense_replace=8", "--tbo needs",
         "0 MoE layers has none"),
    case("tbo-nothing-to-split", "check --tbo --override first_k_dense_replace=0",
         "first_k_dense_replace=0 leaves no layer to split", "0 < first_k_dense_replace < 8"),
    case("tbo-one-token", "capture --tbo --seq-len 1 --out c.safetensors", "--tbo splits the sequence",
         "at least 2 tokens, got 1"),
    case("tbo-capture-engine-strategy", "capture --tbo --out c.safetensors", "capture --tbo writes the micro-batch "
         "capture only", "--strategy micro-batches"),
    case("tbo-server-without-tbo", "check --tbo --server vllm", "profile vllm", "has no two-batch overlap"),
    case("tbo-mode-ep", "check --tbo --mode ep", "--tbo replays SGLang's two-batch overlap in pure TP only",
         "use --mode tp, not --mode ep"),
    case("tbo-strategy-without-tbo", "check --strategy micro-batches", "'micro-batches' captures two-batch overlap",
         "give --tbo too"),
    case("mode-strategy-with-points", "capture --points embed.out --strategy local --mode sp --out c.safetensors",
         "--strategy applies to --layers captures"),
    case("check-seq-len-huge", "check --seq-len 1000000000000", "--seq-len 1000000000000", "at most"),
    case("check-timeout-1e400", "check --timeout 1e400", "--timeout inf", "positive, finite"),
    case("check-timeout-1e10", "check --timeout 1e10", "--timeout 1e+10", "up to 604800"),
    case("capture-tokens-over-max-positions", ["capture", "--out", "c.safetensors", "--tokens", ",".join(["1"] * 4097)],
         "--tokens gives 4097 tokens", "max_position_embeddings=4096"),
    case("check-seed-2**70", f"check --seed {SEED_2_70}", f"--seed {SEED_2_70} is out of range"),
    case("check-tp-double-dash", "check --tp=--", "--tp needs a value, not '--'"),
    case("check-unknown-builtin-model", "check --model deepseek-v4", "deepseek-v4 does not exist",
         "built-in name", "deepseek-v3"),
    case("check-model-png", "check --model {png.yaml}", "png.yaml is not a text file", "YAML/JSON"),
    case("check-model-safetensors", "check --model {st}", "st.safetensors is not a text file", "YAML/JSON"),
    case("check-model-fifo", "check --model {fifo}", "fifo is not a regular file"),
    case("check-model-proc-self-mem", "check --model /proc/self/mem", "cannot read config /proc/self/mem"),
    case("check-model-yaml-alias-bomb", "check --model {alias-bomb.yaml}", "YAML aliases", "not allowed"),
    case("check-model-hidden-size-10**400", "check --model {huge.yaml}", "about 10^", "check the sizes"),
    case("check-override-date", "check --override hidden_act=2001-13-45", "hidden_act='2001-13-45'"),
    # found by test_fuzz_no_traceback: an empty value is null, and a null MLA dimension was summed (TypeError)
    case("check-override-mla-dim-null", "check --override qk_nope_head_dim=", "qk_nope_head_dim is null",
         "positive integer"),
    case("check-model-name-with-newline", ["check", "--model", "no\nsuch.yaml"], "no\\nsuch.yaml does not exist"),
    case("check-override-deep-yaml", ["check", "--override", "num_hidden_layers=" + "[" * 2000], "--override",
         "not a number"),
    case("check-unknown-device", "check --device tpu", "--device", "'tpu'", "cuda"),
    # --- model families --------------------------------------------------------------------------------
    case("family-tp-neither-divides-nor-multiple-of-kv-heads", "check --model tiny-qwen3 --tp 2 --override "
         "num_attention_heads=6 --override num_key_value_heads=3",
         "--tp 2 neither divides nor is a multiple of num_key_value_heads=3"),
    case("family-kv-heads-not-dividing-heads", "check --model tiny-llama --override num_key_value_heads=3",
         "num_key_value_heads=3 does not divide num_attention_heads=8"),
    case("family-llama-rope-scaling-yarn-missing-original",
         ["check", "--model", "tiny-llama", "--override", "rope_scaling={rope_type: yarn, factor: 4}"],
         "rope_scaling (yarn) needs original_max_position_embeddings"),
    case("family-llama3-rope-high-below-low", ["check", "--model", "tiny-llama", "--override",
         "rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1, "
         "original_max_position_embeddings: 16}"], "high_freq_factor=1 must exceed low_freq_factor=4"),
    case("family-mla-rope-llama3", ["check", "--override", "rope_scaling={rope_type: llama3, factor: 8, "
         "low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16}"],
         "rope_scaling type 'llama3' is not supported for deepseek_v2", "yarn"),
    case("family-gpt-oss-rope-truncate-string", ["check", "--model", "tiny-gpt-oss", "--override",
         "rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 16, truncate: 'false'}"],
         "rope_scaling truncate must be true or false, got 'false'"),
    case("triage-draft-config-is-a-target-config", "triage --draft-config {draft_is_a_target.json} --server sglang",
         "is a target model's config (DeepseekV3ForCausalLM, 61 layers", "give the EAGLE-3 draft's config.json"),
    case("triage-builtin-draft-unknown", "triage --draft-config no-such-draft --server sglang",
         "does not exist", "a built-in draft by name (deepseek-v3-edited-ids, deepseek-v3-top-level-copy, ids-at-top-level)"),
    case("align-draft-off-flag-string", "align --draft-config {draft_off_string.json} " + DRAFT,
         "eagle_config.use_aux_hidden_state must be true or false", "any non-empty string as true"),
    case("align-draft-a-million-ids", "align --draft-config {draft_many_ids.json} " + DRAFT,
         "1000000 layer ids is more than tpsim replays", "an EAGLE-3 draft takes three"),
    case("resolve-more-ids-than-replayed", "resolve --convention sglang-ids --layers " + ",".join(["2"] * 300) +
         " --num-layers 8", "300 layer ids is more than tpsim replays (at most 256)"),
    case("family-gpt-oss-field-as-spelled", "check --model tiny-gpt-oss --override num_local_experts=0",
         "field num_local_experts must be positive, got 0"),
    case("family-qwen3-moe-field-as-spelled", "check --model tiny-qwen3-moe --override num_experts=0",
         "field num_experts must be positive, got 0"),
    case("profile-at-without-version", "resolve --server sglang@ --layers 1,2,3 --num-layers 8",
         "has an @ and no version", "sglang@latest"),
    case("profile-fullwidth-digits", "resolve --server sglang@\uff10.\uff15.12 --layers 1,2,3 --num-layers 8",
         "is neither a release"),
    case("profile-leading-zero", "resolve --server sglang@0.05.12 --layers 1,2,3 --num-layers 8",
         "'0.05.12' of sglang is neither a release"),
    case("profile-with-a-space", ["resolve", "--server", " sglang@0.5.12", "--layers", "1,2,3", "--num-layers", "8"],
         "holds a space"),
    case("profile-date-before-the-first-release", "align --draft-config {draft_ok.json} --server vllm "
         "--train specforge@1999-01-01 --num-layers 61", "specforge@1999-01-01 is before specforge's first release tpsim knows"),
    case("profile-trainer-as-server", "resolve --server specforge@0.2.0 --layers 1,2,3 --num-layers 8",
         "specforge trains drafts, it serves none", "--train"),
    case("profile-of-another-model-file", "check --server sglang@0.5.12:llama --tp 1",
         "replays the model file for llama, mistral, not this target's model_type deepseek_v2",
         "sglang's :deepseek_v2 serves it"),
    case("profile-of-another-model-file-gpt-oss", "check --server sglang@0.5.12:gpt_oss --tp 1",
         "not this target's model_type deepseek_v2"),
    case("family-qwen3-missing-head-dim", "check --model {qwen3_no_head_dim.json}",
         "missing required field head_dim", "Qwen3Config"),
    case("family-llama-mlp-bias", "check --model {llama_mlp_bias.json}", "mlp_bias=true", "not supported for llama"),
    case("family-qwen3-moe-ep-experts", "check --model tiny-qwen3-moe --mode ep --tp 1,4 --override num_experts=6",
         "--mode ep at --tp 4", "num_experts=6"),
    case("family-model-type-mixtral", "check --model {mixtral.json}", "model_type='mixtral' is not supported",
         "llama, qwen3, qwen3_moe, gpt_oss"),
    case("family-gpt-oss-layer-types-short", "check --model tiny-gpt-oss --override layer_types=[full_attention]",
         "layer_types names 1 layers, num_hidden_layers is 8"),
    case("family-gpt-oss-sliding-without-window", "check --model tiny-gpt-oss --override sliding_window=null",
         "sliding_attention layers but sliding_window is None"),
    # --- capture -------------------------------------------------------------------------------------
    case("capture-tokens-huge", "capture --tokens 99999999999999999999 --out c.safetensors",
         "id 99999999999999999999 is outside the vocabulary", "vocab_size=1000"),
    case("capture-points-negative-layer", "capture --points layers.-1.out --out c.safetensors",
         "unknown point 'layers.-1.out'"),
    case("capture-out-empty", ["capture", "--out", ""], "is a directory", "capture.safetensors"),
    case("capture-out-fifo", "capture --out {fifo}", "fifo is not a regular file"),
    case("capture-out-device", "capture --out /dev/null", "/dev/null is not a regular file"),
    case("capture-out-symlink", "capture --out {link.safetensors}", "is a symbolic link", "cfg.yaml"),
    case("capture-out-is-the-config", "capture --model {cfg.yaml} --out {cfg.yaml}", "tpsim writes safetensors here"),
    case("capture-points-out-fifo", "capture --points embed.out --out {pf.safetensors}",
         "pf.rank0.safetensors is not a regular file"),
    case("capture-out-name-too-long", f"capture --out {LONG}.safetensors", "path is too long"),
    case("capture-out-name-252-bytes", f"capture --out {'n' * 240}.safetensors", "the name is too long",
         "temporary file"),
    case("capture-override-empty", ["capture", "--override", "", "--out", "c.safetensors"], "is not FIELD=VALUE"),
    case("capture-ckpt-weights-png", "capture --model {ckpt_png} --out c.safetensors", "model.safetensors",
         "safetensors file"),
    case("capture-ckpt-weights-fifo", "capture --model {ckpt_fifo} --out c.safetensors",
         "model.safetensors is not a regular file"),
    case("capture-ckpt-index-deep-json", "capture --model {ckpt_deep_index} --out c.safetensors",
         "is not a safetensors index"),
    case("capture-ckpt-header-bad-shape", "capture --model {ckpt_bad_entry} --out c.safetensors", "bad entry for x"),
    case("capture-tokens-and-seq-len", "capture --tokens 1,2 --seq-len 5 --out c.safetensors",
         "--tokens and --seq-len both"),
    # --- export --------------------------------------------------------------------------------------
    case("export-max-shard-size-1e300TB", "export --out e --max-shard-size 1e300TB", "'1e300TB' is not a size"),
    case("export-max-shard-size-negative", "export --out e --max-shard-size=-5GB", "'-5GB' is not a size"),
    case("export-num-hidden-layers-1e9", "export --out e --override num_hidden_layers=1000000000", "needs", "free",
         "num_hidden_layers"),
    case("export-hidden-size-1e19", "export --out e --override hidden_size=10000000000000000000",
         "vocab_size x hidden_size makes a tensor of", "check the sizes"),
    case("export-unknown-dtype", "export --out e --dtype float8", "--dtype", "'float8'", "bfloat16"),
    case("export-model-fifo", "export --out e --model {fifo}", "is not a regular file"),
    case("export-approximated-family", "export --out e --model qwen3.5-9b --override num_hidden_layers=1",
         "model_type qwen3_5 is an approximation in tpsim", "export or compare another family"),
    case("export-out-current-directory", "export --out .", "--out . is the current directory", "ckpt"),
    case("export-out-empty", ["export", "--out", ""], "is the current directory"),
    case("export-override-rope-beta-zero",
         ["export", "--out", "e", "--override", "rope_scaling={type: yarn, factor: 4, beta_fast: 0}"],
         "rope_scaling beta_fast must be a positive number"),
    case("export-override-rope-theta-negative", "export --out e --override rope_theta=-1",
         "rope_theta=-1 must be positive"),
    # --- explain -------------------------------------------------------------------------------------
    case("explain-tp-huge", "explain --tp 1000000000", "--tp 1000000000 does not divide"),
    case("explain-layer-huge", "explain --layer 99999999999999999999", "--layer 99999999999999999999 does not exist",
         "0..7"),
    case("explain-timeout-zero", "explain --timeout 0", "--timeout 0 must be a positive"),
    case("explain-svg-double-dash", "explain --svg=--", "--svg needs a value"),
    case("explain-dense-1e9-layers",  # finding the first MoE layer must not loop over 10**9 layers
         "explain --override num_hidden_layers=1000000000 --override n_routed_experts=null --seq-len 0",
         "--seq-len 0 must be at least 1"),
    case("explain-model-empty", "explain --model {empty.yaml}", "empty.yaml is empty"),
    case("explain-svg-is-directory", "explain --tp 1 --svg {dir}", "is a directory", "explain.svg"),
    case("explain-svg-empty", ["explain", "--svg", ""], "--svg is empty"),
    # --- align ---------------------------------------------------------------------------------------
    case("align-ids-empty", "align --train specforge-ids: --serve vllm-ids:default --num-layers 61",
         "'' is not a comma-separated list of integers"),
    case("align-profile-name-as-serve", "align --train specforge-ids:1,29,57 --serve sglang:-1,2,30 --num-layers 61",
         '--serve sglang:-1,2,30: "sglang" names an engine profile', "write --serve sglang-ids:-1,2,30"),
    case("align-profile-name-as-train", "align --train specforge:1,29,57 --serve sglang-ids:default --num-layers 61",
         '"specforge" names a trainer profile', "write --train specforge-ids:1,29,57"),
    case("align-seed-2**70", f"align {SIDES} --model tiny --seed {SEED_2_70}", f"--seed {SEED_2_70} is out of range"),
    case("align-timeout-nan", f"align {SIDES} --model tiny --timeout nan", "--timeout nan must be a positive"),
    case("align-model-fifo", f"align {SIDES} --model {{fifo}}", "is not a regular file"),
    case("align-draft-dir-without-config", f"align --draft-config {{dir}} {DRAFT}", "config.json does not exist"),
    case("align-draft-fifo", f"align --draft-config {{fifo}} {DRAFT}", "fifo is not a regular file"),
    case("align-draft-png", f"align --draft-config {{png.json}} {DRAFT}", "png.json is not a text file"),
    case("align-draft-deep-json", f"align --draft-config {{deep.json}} {DRAFT}", "nested too deeply"),
    case("align-draft-empty-ids", "align --draft-config {draft_empty_ids.json} --server sglang --num-layers 61",
         "eagle_config.eagle_aux_hidden_state_layer_ids is an empty list", "remove the key"),
    case("align-draft-bool-ids", f"align --draft-config {{draft_bool_ids.json}} {DRAFT}",
         "not a list of integer layer ids"),
    case("align-ids-and-trainer", f"align {SIDES} --trainer specforge --num-layers 61", "not both"),
    # --- diagnose ------------------------------------------------------------------------------------
    case("diagnose-hidden-size-negative", "diagnose {good} --reference {ref} --hidden-size=-1",
         "--hidden-size -1 must be at least 1"),
    case("diagnose-reference-double-dash", "diagnose {good} --reference=--", "--reference needs a value"),
    case("diagnose-sglang-plain-pickle", "diagnose {sgl_pickle} --reference {ref}",
         "cannot be read with torch.load(weights_only=True)", "pass tensor dumps only"),
    case("diagnose-sglang-rank-1e11", "diagnose {sgl_huge_rank} --reference {ref}",
         "rank 0 of tp=100000000000 is missing"),
    case("diagnose-dump-tp-1e11", "diagnose {hugetp} --reference {ref}", "rank 1 of tp=99999999999 is missing"),
    case("diagnose-dump-tp-zero", "diagnose {tp0} --reference {ref}", "rank=0, tp=0 is not a rank of a TP group"),
    case("diagnose-sglang-rank-superscript", "diagnose {sgl_sup_rank} --reference {ref}",
         "is not named like an SGLang dumper file"),
    case("diagnose-file-empty-directory", "diagnose {dir} --reference {ref}", "holds no *.safetensors or *.pt"),
    case("diagnose-file-fifo", "diagnose {fifo} --reference {ref}", "fifo is not a file"),
    case("diagnose-sglang-png", "diagnose {sgl_png} --reference {ref}", "cannot be read with torch.load"),
    case("diagnose-reference-1d", "diagnose {good} --reference {ref_1d}", "[5]", "expected [T, n*hidden]"),
    case("diagnose-file-twice", "diagnose {good} {good} --reference {ref}", "named twice"),
    # --- --cuda-graph ---------------------------------------------------------------------------------
    case("graph-ids-without-cuda-graph", "check --graph-ids none", "--graph-ids applies with --cuda-graph"),
    case("graph-tokens-without-cuda-graph", "check --graph-tokens 2", "--graph-tokens applies with --cuda-graph"),
    case("graph-ids-unknown", "check --cuda-graph --graph-ids later", "unknown --graph-ids 'later'", "config"),
    case("graph-tokens-not-fewer", "check --cuda-graph --graph-tokens 8 --seq-len 8",
         "--graph-tokens 8 must be at least 1 and fewer than the 8 tokens run", "--seq-len 9"),
    case("graph-tokens-text", "check --cuda-graph --graph-tokens four", "--graph-tokens 'four' is not an integer"),
    case("graph-ids-with-server", "check --cuda-graph --graph-ids none --server sglang",
         "--server sglang decides what its graphs capture", "drop --graph-ids"),
    case("graph-dp-attention", "check --cuda-graph --mode dp-attention", "--cuda-graph runs without --mode dp-attention"),
    # --- --prefix-cached ---------------------------------------------------------------------------
    case("prefix-cached-every-token", "check --prefix-cached 8 --seq-len 8",
         "--prefix-cached 8 leaves none of the 8 tokens to run", "use --prefix-cached 7 or less"),
    case("prefix-cached-zero", "check --prefix-cached 0", "--prefix-cached 0 must be at least 1", "drop it"),
    case("prefix-cached-text", "check --prefix-cached three", "--prefix-cached 'three' is not an integer",
         "--prefix-cached 3"),
    case("prefix-cached-sp", "check --prefix-cached 3 --mode sp", "--mode tp or ar-fusion only, not --mode sp",
         "drop --mode or --prefix-cached"),
    case("prefix-cached-cp", "check --prefix-cached 3 --mode cp --tp 1,2", "not --mode cp"),
    case("prefix-cached-tbo", "check --prefix-cached 3 --tbo", "--prefix-cached 3 and --tbo together",
         "drop one of them"),
    case("prefix-cached-pp", "check --prefix-cached 3 --pp 2 --tp 1", "--prefix-cached 3 and --pp together"),
    case("prefix-cached-capture", "capture --prefix-cached 3 --out c.safetensors", "--prefix-cached"),
    # --- scenario ------------------------------------------------------------------------------------
    case("scenario-unknown-case", "scenario Align-Default-Fallback", "unknown scenario 'Align-Default-Fallback'",
         "align-default-fallback"),
    case("scenario-relative-path", "scenario ../tiny", "unknown scenario '../tiny'"),
    case("scenario-absolute-path", f"scenario {ROOT}/configs/tiny", "unknown scenario", "--list"),
    case("scenario-empty-name", ["scenario", ""], "unknown scenario ''"),
    case("scenario-list-and-name", "scenario --list align-default-fallback",
         "--list and 'align-default-fallback' both given", "pass one of --list, --all or a scenario name"),
    case("scenario-all-and-name", "scenario --all align-default-fallback", "--all and 'align-default-fallback'"),
    case("scenario-json-without-all", "scenario --json", "--json reports a run of every scenario", "--all"),
    # --- verify --------------------------------------------------------------------------------------
    case("verify-missing", "verify nope.safetensors", "nope.safetensors does not exist"),
    case("verify-fifo", "verify {fifo}", "fifo is not a regular file"),
    case("verify-empty-directory", "verify {dir}", "holds no *.safetensors"),
    case("verify-no-path", "verify", "the following arguments are required"),
    case("verify-missing-in-dir", "verify {dir}/nope.safetensors", "nope.safetensors does not exist"),
    # --- resolve -------------------------------------------------------------------------------------
    case("resolve-layers-malformed", "resolve --convention vllm-ids --layers 1..3 --num-layers 8", "--layers '1..3'"),
    case("resolve-unknown-convention", "resolve --convention vLLM --num-layers 8", "unknown convention 'vLLM'",
         CONVENTIONS),
    case("resolve-profile-name-as-convention", "resolve --convention sglang --num-layers 8",
         '"sglang" names an engine profile', "write --convention sglang-ids"),
    case("resolve-convention-name-as-server", "resolve --server sglang-boundary-ids --num-layers 8",
         '"sglang-boundary-ids" names an idealised convention', "write --server sglang-boundary"),
    case("resolve-unknown-builtin-model", "resolve --convention sglang-ids --model deepseek-v2", "does not exist",
         "deepseek-v2-lite"),
    case("resolve-model-png", "resolve --convention sglang-ids --model {png.yaml}", "is not a text file"),
    case("resolve-num-layers-and-model", "resolve --convention sglang-ids --num-layers 61 --model tiny",
         "--num-layers and --model both"),
    # --- no command ----------------------------------------------------------------------------------
    case("no-command", [], "required", "command"),
    case("unknown-command", "checkk", "invalid choice: 'checkk'", "check"),
]
assert len({c.id for c in CASES}) == len(CASES)


def expand(argv: tuple[str, ...], inputs: dict[str, Path]) -> list[str]:
    out = []
    for a in argv:
        if a.startswith("{") and "}" in a and a[1:a.index("}")] in inputs:
            key = a[1:a.index("}")]
            v = inputs[key]
            out += [str(p) for p in v] if isinstance(v, list) else [str(v) + a[a.index("}") + 1:]]
        else:
            out.append(a)
    return out


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory):
    """Every case, once, four at a time; the input files' state before and after all of them."""
    base = tmp_path_factory.mktemp("cwd")
    before = snapshot(inputs["dir"].parent)
    pool = ThreadPoolExecutor(max_workers=4)
    futures = {}
    for c in CASES:
        cwd = base / c.id.replace("*", "_")
        cwd.mkdir()
        futures[c.id] = pool.submit(run_cli, *expand(c.argv, inputs), cwd=cwd, timeout_s=CASE_TIMEOUT_S)
    yield futures, before
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_is_one_line_exit_2(case: Case, runs, inputs):
    futures, before = runs
    r = futures[case.id].result()
    assert_one_line_error(r, case.expect)
    assert sorted(p.name for p in r.cwd.iterdir()) == [], f"{r}\nwrote into its working directory"


@pytest.mark.parametrize("target,words", [("{png.safetensors}", "not a complete safetensors file"),
                                          ("{empty.safetensors}", "too short for a header"),
                                          ("{ckpt_bad_entry}", "bad entry for x")])
def test_verify_gives_a_verdict_on_a_file_that_is_not_whole(inputs, tmp_path, target, words):
    """A file that is not a whole safetensors file is what verify is asked about: a FAIL line and
    exit 1 (it was exit 2, as if the question were wrong)."""
    r = run_cli("verify", *expand((target,), inputs), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r
    assert [x for x in r.stdout.splitlines() if x.startswith("FAIL ")] and words in r.stdout, r


def test_no_case_wrote_into_the_inputs(runs, inputs):
    futures, before = runs
    for f in futures.values():
        f.result()
    assert snapshot(inputs["dir"].parent) == before


def test_every_command_has_cases():
    per = {}
    for c in CASES:
        per[c.argv[0] if c.argv else "(none)"] = per.get(c.argv[0] if c.argv else "(none)", 0) + 1
    assert all(per.get(cmd, 0) >= 5 for cmd in FUZZ), per
    assert len(CASES) >= 80


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    return write_inputs(tmp_path_factory.mktemp("inputs"))


def snapshot(d: Path) -> list:
    return sorted((str(p), p.is_dir() or p.stat().st_mtime_ns) for p in d.rglob("*"))


# --- the fuzz: arbitrary strings at every option of every command, in process -------------------

# NUL-free (argv cannot hold NUL) and no lone surrogates (a shell passes UTF-8). At most 50
# characters (200 bytes): longer file names than NAME_MAX (255 bytes) are catalogue cases
# (`*-name-too-long`).
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=50)
SPECIAL = st.sampled_from(["", " ", "-", "--", "-1", "0", "1", "1e400", "-1e400", "nan", "inf", "1" * 40, "2**70",
                           "١٢", " 1", "1,", ",", ",,", "1,,2", "a=b", "=", ":", "default", ".", "/", "..", "~",
                           "/dev/null", "/proc/self/mem", "☃", "1_000", "0x10", "-0", "+1", "1.0", "true", "null"])
VALUES = st.one_of(TEXT, TEXT.map(lambda s: "-" + s), SPECIAL)
CONFIG_FIELDS = [k for k in TINY if k != "vocab_size"] + ["n_group", "rope_scaling", "rope_theta", "model_type",
                                                          "hidden_act", "num_key_value_heads"]


def option_values(option: str):
    """Arbitrary strings, plus for structured options the structure with an arbitrary part."""
    if option == "--override":
        tricky = st.sampled_from(["{type: yarn, factor: x}", "{type: yarn}", "[1]", "-1", "1e6", "0", "yes", "[[[[",
                                  "!!python/name:os.system", "{type: yarn, factor: 4, beta_fast: 0}", "*x", "&a 4"])
        return st.one_of(VALUES, st.builds("{}={}".format, st.sampled_from(CONFIG_FIELDS), st.one_of(VALUES, tricky)))
    if option in ("--train", "--serve"):
        return st.one_of(VALUES, st.builds("{}:{}".format, st.sampled_from(CONVENTIONS.split(", ") + OLD_CONVENTIONS + ["x"]), VALUES))
    if option in ("--points", "--point"):
        return st.one_of(VALUES, st.builds("layers.{}.{}".format, VALUES, st.sampled_from(["out", "mlp.in", "attn.q"])))
    return VALUES


RUN = ["--tp", "1", "--seq-len", "2", "--backend", "nccl"]  # valid, then refused after all validation
RUN_OPTIONS = ["--model", "--layers", "--convention", "--dtype", "--seq-len", "--seed", "--device", "--backend",
               "--timeout", "--override", "--tp"]
ALIGN_RUN = ["--train", "specforge-ids:1,2,3", "--serve", "vllm-ids:default", "--model", "tiny", "--seq-len", "2",
             "--backend", "nccl"]
FUZZ = {  # command -> option ("FILE": a positional) -> the command line before the fuzzed value
    "check": {o: ["check", *RUN] for o in RUN_OPTIONS},
    "capture": {o: ["capture", *RUN, "--out", "x.safetensors"] for o in [*RUN_OPTIONS, "--tokens", "--out", "--points"]},
    # an export far larger than any disk: refused by the free-space check, after every other one
    "export": {o: ["export", "--out", "e", "--override", "vocab_size=1000000000000"]
               for o in ["--model", "--seed", "--out", "--dtype", "--max-shard-size", "--override"]},
    "explain": {**{o: ["explain", *RUN] for o in [*RUN_OPTIONS, "--layer"]}, "--svg": ["explain", *RUN]},
    "align": {"--train": ["align", "--serve", "vllm-ids:default", "--num-layers", "61"],
              "--serve": ["align", "--train", "specforge-ids:1,29,57", "--num-layers", "61"],
              "--draft-config": ["align", "--server", "vllm", "--num-layers", "61"],
              "--trainer": ["align", "--draft-config", "{draft_ok.json}", "--server", "vllm", "--num-layers", "61"],
              "--server": ["align", "--draft-config", "{draft_ok.json}", "--num-layers", "61"],
              "--num-layers": ["align", "--train", "specforge-ids:1,29,57", "--serve", "sglang-ids:default"],
              **{o: ["align", *ALIGN_RUN] for o in ["--model", "--override", "--tp", "--dtype", "--seq-len", "--seed",
                                                    "--device", "--backend", "--timeout"]}},
    "diagnose": {"FILE": ["diagnose", "--reference", "{ref}"],
                 **{o: ["diagnose", "{good}", "--reference", "{ref}"]
                    for o in ["--reference", "--point", "--positions", "--hidden-size", "--step"]}},
    "scenario": {"FILE": ["scenario"]},
    "verify": {"FILE": ["verify"]},
    "resolve": {o: ["resolve", "--convention", "sglang-ids", "--num-layers", "8"]
                for o in ["--convention", "--layers", "--num-layers", "--model"]},
}
# Exit 1 means "a property failed" for check (a row), align (not aligned), diagnose (a point is not
# Replicate() of the asked tensor) and verify (a checksum mismatch): a fuzzed value can be valid
# input that fails the property, which is not an error. Every other command has no property to fail.
PROPERTY_EXIT_1 = {"check", "align", "diagnose", "verify"}
FUZZ_IDS = [f"{cmd} {opt}" for cmd, opts in FUZZ.items() for opt in opts]
FUZZ_EXAMPLES = int(os.environ.get("TPSIM_FUZZ_EXAMPLES", "20"))  # per option (71 options): ~1500 examples, ~7 s
FUZZ_STATS = {"examples": 0, "seconds": 0.0}


def fill(argv: list[str], inputs: dict[str, Path]) -> list[str]:
    out = []
    for a in argv:
        if a == "{good}":
            out += [str(p) for p in inputs["good"]]
        elif a.startswith("{") and a.endswith("}"):
            key = a[1:-1]
            out.append(str(inputs[key] if key in inputs else inputs["dir"].parent / key))
        else:
            out.append(a)
    return out


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """`run_command(argv)` with stdout and stderr captured (rich's consoles write to sys.stdout /
    sys.stderr as they are at print time, see test_in_process_capture_sees_rich_output)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_command(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def clean_env():
    with pytest.MonkeyPatch.context() as mp:
        for k in SCRUB:
            mp.delenv(k, raising=False)
        yield


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory, clean_env):
    d = tmp_path_factory.mktemp("fuzz")
    yield d
    if FUZZ_STATS["examples"]:
        print(f"\nfuzz: {FUZZ_STATS['examples']} examples in {FUZZ_STATS['seconds']:.1f} s "
              f"({FUZZ_STATS['examples'] / FUZZ_STATS['seconds']:.0f}/s)", file=sys.__stderr__)


def test_in_process_capture_sees_rich_output(clean_env):
    """The fuzz's capture works: rich's stdout console (tables) writes into redirect_stdout."""
    from tpsim.base.ui import table
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        table(["a"], [["rich-cell"]])
    assert "rich-cell" in out.getvalue()
    code, text, err = run_in_process(["resolve", "--convention", "vllm-ids", "--num-layers", "8"])
    assert code == 0 and "aux_hidden_state_layers: [2, 4, 5]" in text and err == ""


OLD_SPELLINGS = {  # where a convention is taken: (argv around it, the option, whether it takes CONVENTION:IDS)
    "check": (["check", "--tp", "1"], "--convention", False),
    "capture": (["capture", "--tp", "1", "--out", "x.safetensors"], "--convention", False),
    "resolve": (["resolve", "--num-layers", "61"], "--convention", False),
    "diagnose": (["diagnose", "x.safetensors", "--reference", "y.safetensors", "--layer-ids", "1,2"], "--convention",
                 False),
    "align-train": (["align", "--serve", "vllm-ids:default", "--num-layers", "61"], "--train", True),
    "align-serve": (["align", "--train", "specforge-ids:default", "--num-layers", "61"], "--serve", True),
}


@settings(max_examples=60, deadline=None)
@given(where=st.sampled_from(sorted(OLD_SPELLINGS)), old=st.sampled_from(OLD_CONVENTIONS),
       ids=st.one_of(st.just("default"), st.lists(st.integers(-3, 80), min_size=1, max_size=4).map(
           lambda v: ",".join(map(str, v)))), joined=st.booleans())
@example(where="align-serve", old="sglang", ids="-1,2,30", joined=False)
def test_the_old_convention_spelling_is_refused_with_the_new(clean_env, tmp_path_factory, where, old, ids, joined):
    """`--convention sglang`, `--serve sglang:-1,2,30`: "sglang" is the engine profile now; every
    place that takes a convention refuses the bare name in one line that spells out the fix."""
    base, option, with_ids = OLD_SPELLINGS[where]
    value = f"{old}:{ids}" if with_ids else old
    argv = [*base, f"{option}={value}"] if joined else [*base, option, value]
    old_cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("old-spelling"))
    try:
        code, out, err = run_in_process(argv)
    finally:
        os.chdir(old_cwd)
    fix = f"{old}-ids:{ids}" if with_ids else f"{old}-ids"
    assert code == 2 and out == "" and err.count("\n") == 1, (argv, out, err)
    assert err.startswith(f"tpsim: error: {option} {value}: \"{old}\" names "), err
    assert err.rstrip().endswith(f"write {option} {fix}"), err


@pytest.mark.parametrize("command,option", [(c, o) for c, opts in FUZZ.items() for o in opts], ids=FUZZ_IDS)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), joined=st.booleans())
@example(data=None, joined=True)  # the empty string, always
def test_fuzz_no_traceback(inputs, fuzz_dir, command, option, data, joined):
    value = "" if data is None else data.draw(option_values(option), label="value")
    base = fill(FUZZ[command][option], inputs)
    if option == "FILE":
        argv = [*base, *(["--"] if joined else []), value]  # `--`: a value with a leading dash is still a file
    else:
        argv = [*base, f"{option}={value}"] if joined else [*base, option, value]
    cwd = Path(tempfile.mkdtemp(dir=fuzz_dir))
    before = snapshot(inputs["dir"].parent)
    old = os.getcwd()
    t0 = time.perf_counter()
    os.chdir(cwd)
    try:
        code, out, err = run_in_process(argv)
    except BaseException as e:  # an exception run_command let escape: the traceback a user would see
        raise AssertionError(f"tpsim {argv!r} raised {e.__class__.__name__}: {e}") from e
    finally:
        os.chdir(old)
        FUZZ_STATS["examples"] += 1
        FUZZ_STATS["seconds"] += time.perf_counter() - t0
    allowed = {0, 2} | ({1} if command in PROPERTY_EXIT_1 else set())
    assert code in allowed, f"tpsim {argv!r} -> exit {code}\n{out}{err}"
    assert "Traceback" not in out + err, f"tpsim {argv!r}\n{out}{err}"
    if code == 2:
        # one line, even when the fuzzed value holds a line break (printed escaped)
        assert err.startswith("tpsim: error: ") and err.count("\n") == 1 and err.endswith("\n") \
            and "\r" not in err, f"tpsim {argv!r}\n{err}"
    assert "tpsim: starting" not in err, f"tpsim {argv!r} spawned ranks"
    if code != 0:
        assert list(cwd.iterdir()) == [], f"tpsim {argv!r} failed but wrote {list(cwd.iterdir())}"
    assert snapshot(inputs["dir"].parent) == before, f"tpsim {argv!r} changed an input file"


ENV_CASES = {  # the environment, checked before anything starts: one line from every process, exit 2
    "rank-alone": ({"RANK": "1"}, ["RANK set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"]),
    "no-rendezvous": ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["MASTER_ADDR, MASTER_PORT not"]),
    "world-not-a-number": ({"RANK": "0", "WORLD_SIZE": "abc", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "29500"}, ["WORLD_SIZE='abc' is not valid"]),
    "rank-past-world": ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "29500"}, ["RANK=2 with WORLD_SIZE=2"]),
    "fault-garbage": ({"TPSIM_FAULT": "garbage"}, ["TPSIM_FAULT='garbage' is not RANK:WHERE:HOW"]),
    "fault-rank-not-a-number": ({"TPSIM_FAULT": "x:write:raise"}, ["TPSIM_FAULT='x:write:raise'"]),
    "rank-start-unknown": ({"TPSIM_RANK_START": "spawn"}, ["TPSIM_RANK_START='spawn' is not one of fork, forkserver"]),
}


ENV_COMMANDS = {"check": ["check", "--tp", "1"], "export": ["export", "--out", "ck"]}


@pytest.fixture(scope="module")
def env_runs(tmp_path_factory):
    """Every (environment case, command) run once, two at a time, each in its own empty directory."""
    def run(key):
        name, command = key
        cwd = tmp_path_factory.mktemp(f"env-{name}-{command}")
        return run_cli(*ENV_COMMANDS[command], cwd=cwd, env={**cli_env(), **ENV_CASES[name][0]}, timeout_s=120), cwd
    keys = [(n, c) for n in ENV_CASES for c in ENV_COMMANDS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(keys, pool.map(run, keys)))


@pytest.mark.parametrize("command", list(ENV_COMMANDS))
@pytest.mark.parametrize("name", list(ENV_CASES))
def test_a_broken_environment_is_one_line_exit_2(env_runs, name, command):
    """Each was a traceback (torchrun variables without a rendezvous, WORLD_SIZE=abc, TPSIM_FAULT=garbage
    on export), a silent exit 2 (RANK=1 alone), or blamed on "rank 0 failed while starting"."""
    expect = ENV_CASES[name][1]
    r, cwd = env_runs[name, command]
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tpsim: error: "), r.stderr
    assert all(e in lines[0] for e in expect), lines[0]
    assert list(cwd.iterdir()) == []  # nothing written


def test_the_memory_guard_counts_the_address_space_limit(tmp_path):
    """Weights that fit the host's memory but not `ulimit -v` were allocated inside a rank and died
    there (exit 3); the guard now refuses them before any rank starts."""
    limit = 4 << 30  # Python with torch maps about 0.7 GB; V2-Lite at 3 layers needs 6.68 GB of float32 weights

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "tpsim", "check", "--model", "deepseek-v2-lite", "--override",
                        "num_hidden_layers=3", "--tp", "1"], cwd=tmp_path, env=cli_env(), capture_output=True,
                       text=True, timeout=120, preexec_fn=cap)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in ("ulimit -v", "6.68 GB", "address-space limit")), r.stderr
