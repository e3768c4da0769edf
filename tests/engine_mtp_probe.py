"""Run by the engine's interpreter (vLLM installed, no tpsim): which hidden state vLLM's CPU build feeds an MTP head,
at step 0 and at the later steps. `ENGINE_PYTHON tests/engine_mtp_probe.py FAMILY OUT_DIR` builds a seeded tiny
checkpoint of FAMILY (glm4_moe, deepseek_v3 or mimo) with one MTP layer, serves it under speculative method "mtp"
with 2 draft tokens, and writes OUT_DIR/probe.json: per call of the MTP layer, which tensor the norm of the hidden
state it is handed (`hnorm`, MiMo's `hidden_layernorm`) was given (the target's last state after or before its
final norm, the head's previous output after or before its own final norm), and the tokens generated. tests/test_engine_mtp.py reads it. The workers import this module by name (tests/ on their
PYTHONPATH)."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

LAYERS, PROMPT, NEW = 2, (3, 17, 42, 8, 99, 23, 5, 61, 12, 77), 8
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS + 1, rms_norm_eps=1e-6,
              max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")
FAMILIES = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        partial_rotary_factor=0.5, use_qk_norm=False, norm_topk_prob=True, routed_scaling_factor=1.0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, rope_scaling=None, topk_method="noaux_tc", scoring_func="sigmoid")),
    "mimo": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=2, num_key_value_heads=2)),
}
# per family: the MTP layer's norm of the hidden state it is handed, and its head's final norm
NORMS = {"glm4_moe": ("hnorm", "shared_head.norm"), "deepseek_v3": ("hnorm", "shared_head.norm"),
         "mimo": ("hidden_layernorm", "final_layernorm")}


def checkpoint(family: str, folder: Path) -> Path:
    """A seeded model of LAYERS + 1 layers saved as LAYERS layers and one MTP layer (the last layer its block, plus
    enorm, hnorm, eh_proj and shared_head.norm), as DeepSeek's and GLM's checkpoints ship theirs."""
    import torch
    import transformers
    from safetensors.torch import save_file
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float()
    tensors = {}
    for k, v in model.state_dict().items():  # transformers 5 holds each layer's experts fused; checkpoints ship them apart
        if k.endswith("experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*v.chunk(2, dim=1))):
                tensors[k[:-len("gate_up_proj")] + f"{e}.gate_proj.weight"] = gate.contiguous()
                tensors[k[:-len("gate_up_proj")] + f"{e}.up_proj.weight"] = up.contiguous()
        elif k.endswith("experts.down_proj"):
            for e, down in enumerate(v):
                tensors[k[:-len("down_proj")] + f"{e}.down_proj.weight"] = down.contiguous()
        else:
            tensors[k] = v.detach().clone().contiguous()
    h, spec = config.hidden_size, f"model.layers.{LAYERS}."
    names = ("enorm", "hnorm", "shared_head.norm", "eh_proj")
    if family == "mimo":  # MiMo's checkpoints keep the MTP layer apart, under model.mtp_layers
        tensors = {(k.replace(spec, "model.mtp_layers.0.") if k.startswith(spec) else k): v for k, v in tensors.items()}
        spec, names = "model.mtp_layers.0.", ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_proj")
    for name in names[:3]:
        tensors[spec + name + ".weight"] = 1 + 0.1 * torch.randn(h)
    tensors[spec + names[3] + ".weight"] = torch.randn(h, 2 * h) * (2 * h) ** -0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    saved = config.to_dict()
    if saved.get("layer_types"):  # one per target layer (Qwen2's config checks the count)
        saved["layer_types"] = saved["layer_types"][:LAYERS]
    saved.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1,
                 architectures=["MiMoForCausalLM" if family == "mimo" else model_name])
    (folder / "config.json").write_text(json.dumps(saved))
    return folder


def hook(worker, family):
    """Record the target's last state before and after its final norm (every forward: from the last layer, since a
    model may apply the norm only to the rows it samples) and, per MTP call, what the layer's norm of the handed
    hidden state was given and what its head's final norm took and gave: in one list, in call order."""
    runner = worker.model_runner
    target, draft = runner.model, runner.drafter.model
    calls = []
    last, norm = target.model.layers[-1], target.model.norm

    def final(*a, _o=last.forward, **k):  # the last layer's (output, residual): their sum is the pre-norm state
        out = _o(*a, **k)
        pre = (out[0] + out[1]).detach().float().clone()
        calls.append({"who": "target", "pre": pre, "post": norm(pre.clone()).detach().float().clone()})
        return out
    last.forward = final
    inner = draft.model
    layer = next(iter((getattr(inner, "layers", None) or inner.mtp_layers).values()))
    fed_norm, head_norm = (layer.get_submodule(n) for n in NORMS[family])

    def fed(_module, args):
        calls.append({"who": "fed", "x": args[0].detach().float().clone()})
    fed_norm.register_forward_pre_hook(fed)

    def head(_module, args, out):
        calls.append({"who": "mtp", "pre": args[0].detach().float().clone(), "post": out.detach().float().clone()})
    head_norm.register_forward_hook(head)
    worker._tpsim_calls = calls
    return type(draft).__name__


def take(worker):
    """Each MTP call's feed, named by the tensor it equals: `target post` / `target pre` (the target's last state
    after / before its final norm, latest forward), `head post` / `head pre` (the MTP layer's previous output after /
    before its head's final norm), or `none`."""
    import torch

    def same(x, ys):
        return ys is not None and all(bool(torch.isclose(r, ys, rtol=1e-5, atol=1e-6).all(-1).any()) for r in x)

    out, target, head = [], None, None
    for c in worker._tpsim_calls:
        if c["who"] == "target":
            target = c
        elif c["who"] == "mtp":
            head = c
        else:
            x = c["x"]
            names = [n for n, ys in (("target post", target and target["post"]), ("target pre", target and target["pre"]),
                                     ("head post", head and head["post"]), ("head pre", head and head["pre"]))
                     if same(x, ys)]
            out.append({"rows": x.shape[0], "fed": names or ["none"]})
    return out


def main(family: str, out: Path) -> int:
    from vllm import LLM, SamplingParams
    ckpt = checkpoint(family, out / "ckpt")
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
              max_model_len=256, max_num_seqs=1, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    head = llm.collective_rpc(functools.partial(hook, family=family))[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, detokenize=False)
    done = llm.generate([{"prompt_token_ids": list(PROMPT)}], params, use_tqdm=False)[0]
    calls = llm.collective_rpc(take)[0]
    import vllm
    served = llm.llm_engine.vllm_config.speculative_config.draft_model_config.hf_config.architectures
    (out / "probe.json").write_text(json.dumps({"vllm": vllm.__version__, "head": head, "architectures": served,
                                                "calls": calls,
                                                "generated": list(done.outputs[0].token_ids)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
