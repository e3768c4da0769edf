"""transformers' model of a tpsim config, built in memory with tpsim's seeded weights, beside tpsim at TP=1
(benchmarks/forward.py, tests/test_bench.py, tests/test_gpu.py)."""

from __future__ import annotations

import inspect
import re
import time

import torch

from tpsim.weights.export import tensor_dtype
from tpsim.base.errors import UsageError
from tpsim.model.decoder import CausalLM
from tpsim.parallel.group import TPGroup
from tpsim.run.jobs import DTYPES
from tpsim.weights.seeded import init_tensor, weight_specs


def strict_fp32() -> None:
    """No TF32 anywhere in this process (matmul and cuDNN): float32 comparisons on CUDA need it.
    PyTorch's default already leaves matmul TF32 off; this makes it explicit and covers cuDNN."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# --- seeded weights for tpsim and transformers at once -----------------------------------------------------------

def seeded_tensors(seed: int, device: torch.device):
    """`fn(name, shape)` -> the full float32 tensor tpsim seeds for that checkpoint name, on `device`:
    `init_tensor(..., device=)` where its signature has it (generated on the device), else
    generated on the CPU and moved."""
    if "device" in inspect.signature(init_tensor).parameters:
        return lambda name, shape: init_tensor(seed, name, shape, device=device)
    return lambda name, shape: init_tensor(seed, name, shape).to(device)


def hf_architecture(cfg) -> str:
    """The transformers class that runs this config (Kimi-K2: DeepseekV3ForCausalLM)."""
    return cfg.family.architecture(cfg.model_type)


def hf_config_for(cfg):
    """The transformers config of a tpsim config (same fields; LlamaConfig, Qwen3MoeConfig, ...)."""
    import transformers
    arch = hf_architecture(cfg)
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    drop = {"model_type", "quantization_config", "architectures", "torch_dtype", "dtype", "tpsim"}
    if arch == "DeepseekV3ForCausalLM":  # transformers' V3 has only noaux_tc / sigmoid and takes neither field
        drop |= {"topk_method", "scoring_func"}
    return cls(**{k: v for k, v in cfg.to_dict().items() if k not in drop})


def hf_unsupported(cfg) -> str | None:
    """Why transformers cannot hold this config's tpsim weights (None when it can)."""
    if cfg.model_type == "deepseek_v2" and cfg.moe_layer_freq != 1 and cfg.n_routed_experts:
        return ("transformers' DeepseekV2 makes every layer >= first_k_dense_replace an MoE layer "
                f"(moe_layer_freq={cfg.moe_layer_freq} is ignored), so it cannot hold tpsim's weights; "
                "use --skip-transformers")
    return None


# transformers' attention implementations, fastest first, as its model classes declare them (`_supports_sdpa`,
# `_supports_flex_attn`): GPT-OSS's sinks have no SDPA path in transformers 5 (GptOssPreTrainedModel sets
# `_supports_sdpa = False`); its flex path adds them (integrations/flex_attention.py, `s_aux`), on CUDA only
# (on the CPU it raises "Attention sinks cannot be run on CPU with flex attention")
HF_ATTENTION = (("sdpa", "_supports_sdpa"), ("flex_attention", "_supports_flex_attn"), ("eager", None))


def hf_attention(cfg, wanted: str = "auto", device: torch.device | str = "cuda") -> str:
    """The attention implementation transformers runs this config with on `device`: `wanted`, or for "auto"
    the first of HF_ATTENTION its model class supports there. One it does not support is a UsageError."""
    import transformers
    cls = getattr(transformers, hf_architecture(cfg))
    cpu_sinks = torch.device(device).type == "cpu" and cfg.family.sinks
    supported = [name for name, flag in HF_ATTENTION if flag is None or (
        getattr(cls, flag, False) and not (name == "flex_attention" and cpu_sinks))]
    if wanted == "auto":
        return supported[0]
    if wanted not in supported:
        raise UsageError(f"transformers' {cls.__name__} does not support attn_implementation={wanted!r} on "
                         f"{torch.device(device).type}; use one of {', '.join(supported)} (or auto)")
    return wanted


def build_hf_model(cfg, dtype: str, device: torch.device, attn_implementation: str = "auto",
                   experts_implementation: str | None = None):
    """transformers' model of the config's family (DeepseekV2ForCausalLM, LlamaForCausalLM, ...) built in memory on `device` in
    `dtype` (router weights stay float32, as transformers keeps them), weights not yet filled."""
    import transformers
    why = hf_unsupported(cfg)
    if why:
        raise UsageError(why)
    cls = getattr(transformers, hf_architecture(cfg))
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": hf_attention(cfg, attn_implementation, device)}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device(device):
        model = cls._from_config(hf_config_for(cfg), **kwargs)
    return model.eval()


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class HFWeights:
    """Copies tpsim checkpoint tensors (HF names) into a transformers model, whatever layout its
    experts have: per-expert modules (checkpoint names), or transformers 5's fused
    `experts.gate_up_proj` `[E, 2I, H]` / `experts.down_proj` `[E, H, I]` (or their transposes,
    `is_transposed`; gate/up interleaved instead of concatenated, `is_concatenated=False`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.tensors = dict(model.named_parameters())
        self.tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
        self.filled: dict[str, int] = {}  # name -> elements written

    def _mark(self, name: str, n: int) -> None:
        self.filled[name] = self.filled.get(name, 0) + n

    def load(self, name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            if name in self.tensors:
                dst = self.tensors[name]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"transformers' {name} is {list(dst.shape)}, tpsim's {list(t.shape)}")
                dst.copy_(t)
                self._mark(name, t.numel())
                return
            m = _EXPERT.match(name)
            if m is None:
                raise KeyError(f"transformers' model has no tensor for checkpoint name {name}")
            prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
            experts = self.model.get_submodule(prefix)
            transposed = getattr(experts, "is_transposed", False)
            if proj == "down_proj":
                key = f"{prefix}.down_proj"
                dst = self.tensors[key][e]
                dst.copy_(t.T if transposed else t)
            else:
                key = f"{prefix}.gate_up_proj"
                fused = self.tensors[key][e]
                if transposed:
                    fused = fused.T  # now [2I, H] like the untransposed layout
                inter = fused.shape[0] // 2
                if getattr(experts, "is_concatenated", True):
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                else:
                    rows = slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2)
                dst = fused[rows]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"transformers' {key}[{e}] {proj} part is {list(dst.shape)}, tpsim's "
                                     f"{name} is {list(t.shape)}")
                dst.copy_(t)
            self._mark(key, t.numel())

    def check_complete(self) -> None:
        """Every parameter (and correction-bias buffer) of the transformers model was written in
        full; a tied lm_head is the embedding's parameter and counts once."""
        missing = [n for n, p in self.tensors.items() if self.filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"tpsim's checkpoint tensors did not fill transformers' {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''}")


def build_models(cfg, seed: int, dtype: str, device: torch.device, transformers: bool = True,
                 attn_implementation: str = "auto", experts_implementation: str | None = None, progress=None):
    """tpsim at TP=1 (a `TPGroup(device=...)`, no process group) and, with `transformers`,
    transformers' model, both holding the same seeded weights: each checkpoint tensor is
    generated once (`seeded_tensors`), cast to the dtype tpsim keeps it in, and copied into both.
    Returns (tpsim model, transformers model or None)."""
    device = torch.device(device)
    model = CausalLM(cfg, TPGroup(device=device), DTYPES[dtype])
    hf = hf_weights = None
    if transformers:
        if progress:
            progress("building transformers' model")
        hf = build_hf_model(cfg, dtype, device, attn_implementation, experts_implementation)
        hf_weights = HFWeights(hf)
    make = seeded_tensors(seed, device)
    specs = list(weight_specs(model))
    last = time.monotonic()
    for i, spec in enumerate(specs):
        t = make(spec.name, spec.shape)
        spec.load(t)
        if hf_weights is not None:
            hf_weights.load(spec.name, t.to(tensor_dtype(spec.name, DTYPES[dtype])))
        del t
        if progress and time.monotonic() - last > 5:
            progress(f"seeding weights: {i + 1}/{len(specs)} tensors")
            last = time.monotonic()
    if hf_weights is not None:
        hf_weights.check_complete()
    return model, hf
