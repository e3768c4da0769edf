"""Run by the engine's interpreter (vLLM installed, no tpsim): where vLLM's CPU build and tpsim part on DeepSeek-V2's
MLA. `ENGINE_PYTHON tests/engine_mla_probe.py CHECKPOINT OUT_DIR TOKENS` writes OUT_DIR/probe.json (the rotary op
on a 3-D and a 2-D query against its own native path) and OUT_DIR/layer0.npz (layer 0's MLA inputs as the model
hands them to the attention: q after RoPE, the normalized latent, k_pe after RoPE; and every layer's output h + r).
tests/test_engine.py reads them. The workers import this module by name (tests/ on their PYTHONPATH)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def hook(model):
    store = {}
    for i, layer in enumerate(model.model.layers):
        def out(*a, _o=layer.forward, _i=i, **k):
            got = _o(*a, **k)
            store.setdefault(f"out{_i}", (got[0] + got[1]).float().clone().numpy())
            return got
        layer.forward = out
    inner = model.model.layers[0].self_attn.mla_attn.mla_attn

    def attn(q, kv_c_normed, k_pe, *a, _o=inner.forward, **k):
        if "q" not in store:
            store.update(q=q.float().clone().numpy(), latent=kv_c_normed.float().clone().numpy(),
                         k_pe=k_pe.float().clone().numpy())
        return _o(q, kv_c_normed, k_pe, *a, **k)
    inner.forward = attn
    model._probe = store
    return True


def take(model):
    return model._probe


def rotary_probe(heads: int, dim: int, tokens: int) -> dict:
    """vLLM's CPU rotary op (forward_cpu) against its own native path, on a [T, heads, dim] query (as the MLA
    layer passes it) and on the same query as [T, heads * dim]."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(dim, max_position=4096, is_neox_style=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    q, k, pos = torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, 1, dim, generator=g), torch.arange(tokens)
    ref_q, _ = rope.forward_native(pos, q.clone(), k.clone())
    three, _ = rope.forward_cpu(pos, q.clone(), k.clone())
    two, _ = rope.forward_cpu(pos, q.clone().reshape(tokens, heads * dim), k.clone().reshape(tokens, dim))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return {"query_3d": rel(three, ref_q), "query_2d": rel(two.view(tokens, heads, dim), ref_q)}


def main(argv: list[str]) -> int:
    import numpy as np
    from vllm import LLM, SamplingParams
    import engine_mla_probe
    ckpt, out, tokens = argv[1], Path(argv[2]), [int(t) for t in argv[3].split(",")]
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    probe = rotary_probe(cfg["num_attention_heads"], cfg["qk_rope_head_dim"], len(tokens))
    (out / "probe.json").write_text(json.dumps(probe))
    # CPU_MLA: the float32 MLA backend (AMX_MLA, where the CPU has AMX, is bf16 only)
    llm = LLM(model=ckpt, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=1, enable_prefix_caching=False, attention_backend="CPU_MLA", seed=0)
    llm.apply_model(engine_mla_probe.hook)
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0, max_tokens=1, detokenize=False),
                 use_tqdm=False)
    np.savez(out / "layer0.npz", **llm.apply_model(engine_mla_probe.take)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
