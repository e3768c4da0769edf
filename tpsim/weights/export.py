"""Write a seeded tpsim model as a Hugging Face checkpoint directory.

`config.json` (the HF fields, `architectures` for transformers) and the weights in
safetensors: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at
most `max_shard_bytes` each plus `model.safetensors.index.json`. Tensors are generated one
at a time exactly as `init_random_weights` generates them, so loading the export gives the
seeded model bit for bit (in the export's dtype). Everything is written into a temporary
directory beside `out`, fsynced, then renamed into place: a killed export leaves `out` as
it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from tpsim import __version__
from tpsim.base.atomic import umask, write_errors_as_os_errors
from tpsim.base.safetensors import tensor_sha256
from tpsim.weights.reader import INDEX, expected_tensors
from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.base import faults
from tpsim.model.decoder import CausalLM, DecoderLayer, layer_kinds
from tpsim.parallel.group import TPGroup
from tpsim.weights.seeded import init_tensor, weight_specs

# kept in float32 by tpsim: the noaux_tc correction bias (as the engines keep it) and GPT-OSS's sink
# logits (its softmax runs in float32); exported so, the seeded model and its export agree bit for bit
FP32_TENSORS = ("e_score_correction_bias", "self_attn.sinks")


def tensor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_TENSORS) else dtype


def plan_shards(cfg: ModelConfig, dtype: torch.dtype, max_shard_bytes: int) -> list[list[tuple[str, tuple]]]:
    """Tensors in model order, grouped greedily into shards of at most max_shard_bytes (a
    tensor larger than that gets a shard of its own)."""
    shards, size = [[]], 0
    for name, shape in expected_tensors(cfg).items():
        n = torch.Size(shape).numel() * tensor_dtype(name, dtype).itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def total_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The checkpoint's size, from one dense and one MoE layer times their counts: building every
    layer, even on the meta device, would take hours for a (mistyped) num_hidden_layers=10**9
    before the free-space check could refuse it."""
    def nbytes(specs) -> int:
        return sum(torch.Size(s.shape).numel() * tensor_dtype(s.name, dtype).itemsize for s in specs)
    meta = TPGroup(device=torch.device("meta"))
    rest = nbytes(weight_specs(CausalLM(dataclasses.replace(cfg, num_hidden_layers=0), meta)))
    return rest + sum(count * nbytes(weight_specs(DecoderLayer(cfg, k, meta, dtype))) for k, count in layer_kinds(cfg))


def hf_config(cfg: ModelConfig, dtype: str, seed: int) -> dict:
    d = {k: v for k, v in cfg.to_dict().items() if k != "quantization_config"}
    return {"architectures": [cfg.family.architecture(cfg.model_type)], **d, "torch_dtype": dtype,
            "tpsim": {"seed": seed, "version": __version__}}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_checkpoint(cfg: ModelConfig, seed: int, out: Path, dtype: str, max_shard_bytes: int,
                      on_tensor=lambda name: None) -> list[str]:
    """Write the checkpoint into `out` (replacing it if it exists) and return the file names."""
    if out.resolve() == Path.cwd().resolve():  # renaming the working directory into place fails (EBUSY)
        raise UsageError(f"--out {out} is the current directory; export into a new directory such as {out / 'ckpt'}")
    cfg.family.architecture(cfg.model_type)  # an approximated family is refused before anything is written
    torch_dtype = getattr(torch, dtype)
    shards = plan_shards(cfg, torch_dtype, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        weight_map, total = {}, 0
        for fname, shard in zip(names, shards):
            tensors = {}
            for name, shape in shard:
                tensors[name] = init_tensor(seed, name, shape).to(tensor_dtype(name, torch_dtype))
                weight_map[name] = fname
                total += tensors[name].numel() * tensors[name].element_size()
                on_tensor(name)
            sums = {f"sha256.{n}": tensor_sha256(t) for n, t in tensors.items()}  # for `tpsim verify`
            with write_errors_as_os_errors(out):
                save_file(tensors, tmp / fname, metadata={"format": "pt", **sums})
            _fsync(tmp / fname)
            del tensors
        files = list(names)
        if len(shards) > 1:
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
            files.append(INDEX)
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype, seed), indent=2))
        files.append("config.json")
        for f in (INDEX, "config.json"):
            if (tmp / f).exists():
                _fsync(tmp / f)
        faults.at("write")
        mask = umask()
        for f in files:  # mkdtemp and safetensors create private files; give them the usual mode
            os.chmod(tmp / f, 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        _replace_dir(tmp, out)
        return files
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename tmp to out; an existing out is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.{os.getpid()}.old"
        os.rename(out, old)
    os.rename(tmp, out)
    _fsync(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
