"""A checkpoint whose stored tensors break a format's rules (MXFP4 blocks and scales, block-FP8 scales)
is refused from its headers, before any rank starts: one line, exit 2. Each once failed inside a rank
(exit 3) or was cast and passed (issue 38)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from clirun import assert_one_line_error, run_clis
from tpsim.config.loader import load_config, with_overrides
from tpsim.weights.export import export_checkpoint
from tpsim.weights.fp8 import quantize as fp8_quantize
from tpsim.weights.mxfp4 import quantize as mxfp4_quantize

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
FP8 = ("_proj.weight", "_proj_with_mqa.weight")


def write(d: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config))
    return d


def mxfp4(root: Path, name: str, change) -> Path:
    """tiny GPT-OSS with MXFP4 experts, `change(blocks, scales)` -> (blocks, scales) applied to each."""
    cfg = with_overrides(load_config(ROOT / "configs" / "tiny-gpt-oss.yaml"), ["num_hidden_layers=2"])
    plain = root / f"{name}-plain"
    export_checkpoint(cfg, 3, plain, "float32", 10**9)
    tensors, out = load_file(str(plain / "model.safetensors")), {}
    for n, t in tensors.items():
        if n.endswith(EXPERTS):
            out[f"{n}_blocks"], out[f"{n}_scales"] = change(*mxfp4_quantize(t))
        else:
            out[n] = t
    config = json.loads((plain / "config.json").read_text())
    return write(root / name, out, {**config, "quantization_config": {"quant_method": "mxfp4"}})


def fp8(root: Path, name: str, block: tuple[int, int], scale_dtype: torch.dtype) -> Path:
    """tiny DeepSeek with block-FP8 linear weights, their scales stored as `scale_dtype`."""
    plain = root / f"{name}-plain"
    export_checkpoint(load_config(ROOT / "configs" / "tiny.yaml"), 3, plain, "float32", 10**9)
    out = {}
    for n, t in load_file(str(plain / "model.safetensors")).items():
        if n.endswith(FP8):
            q, s = fp8_quantize(t, block)
            out[n], out[f"{n}_scale_inv"] = q, s.to(scale_dtype)
        else:
            out[n] = t
    qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return write(root / name, out, {**json.loads((plain / "config.json").read_text()), "quantization_config": qcfg})


CASES = {  # name -> (builder, expected words)
    "mxfp4-blocks-half-width": (lambda r: mxfp4(r, "w", lambda b, s: (b[..., :8], s)),
                                ["_blocks", "MXFP4 blocks are [..., rows, groups, 16]"]),
    "mxfp4-scales-wrong-shape": (lambda r: mxfp4(r, "s", lambda b, s: (b, s[..., :-1])),
                                 ["_scales", "one scale per group"]),
    "mxfp4-scales-float32": (lambda r: mxfp4(r, "f", lambda b, s: (b, s.float())), ["_scales", "is F32", "U8"]),
    "mxfp4-blocks-int8": (lambda r: mxfp4(r, "i", lambda b, s: (b.to(torch.int8), s)), ["_blocks", "is I8", "U8"]),
    "fp8-scale-int32": (lambda r: fp8(r, "q", (16, 16), torch.int32), ["_scale_inv", "is I32", "F32 or BF16"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("badckpt")
    dirs = {k: build(root) for k, (build, _) in CASES.items()}
    return run_clis({k: ["check", "--tp", "1,2", "--model", d] for k, d in dirs.items()})


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_breaking_its_formats_rules_is_refused_before_ranks_start(runs, case):
    assert_one_line_error(runs[case], CASES[case][1])
