"""vLLM's profiles: the DeepSeek-V2/V3 model file (its own capture loop) and the models built on
`EagleModelMixin` (Llama, Qwen, GPT-OSS, ...), from 0.18.0 on, read from the released source
(the PyPI sdist of the version named in each source) and the PRs that changed them.
"""

from __future__ import annotations

from tpsim.profiles.profile import (NESTED, OFF_FLAG, TOP, Behaviour, Change, Cited, ConfigKey, ConfigRead, Defaults,
                                    Duplicates, EmbedId, Empty, Gather, Handoff, Line, Numbering, Order, OutOfRange,
                                    Site, Source, releases)

REPO = "vllm-project/vllm"
RELEASES = releases(
    "0.8.0 2025-03-18, 0.8.1 2025-03-19, 0.8.2 2025-03-25, 0.8.3 2025-04-06, 0.8.4 2025-04-15, "
    "0.8.5 2025-04-28, 0.8.5.post1 2025-05-02, 0.9.0 2025-05-28, 0.9.0.1 2025-05-30, 0.9.1 2025-06-10, "
    "0.9.2 2025-07-08, 0.10.0 2025-07-25, 0.10.1 2025-08-19, 0.10.1.1 2025-08-20, 0.10.2 2025-09-13, "
    "0.11.0 2025-10-04, 0.11.1 2025-11-19, 0.11.2 2025-11-20, 0.12.0 2025-12-03, 0.13.0 2025-12-19, "
    "0.14.0 2026-01-20, 0.14.1 2026-01-24, 0.15.0 2026-01-29, 0.15.1 2026-02-05, 0.16.0 2026-02-26, "
    "0.17.0 2026-03-07, 0.17.1 2026-03-11, 0.18.0 2026-03-20, 0.18.1 2026-03-31, 0.19.0 2026-04-03, "
    "0.19.1 2026-04-18, 0.20.0 2026-04-27, 0.20.1 2026-05-03, 0.20.2 2026-05-10, 0.21.0 2026-05-15, "
    "0.22.0 2026-05-29, 0.22.1 2026-06-05, 0.23.0 2026-06-13, 0.24.0 2026-06-30, 0.25.0 2026-07-11, "
    "0.25.1 2026-07-14, 0.26.0 2026-07-25, 0.27.0 2026-08-10, 0.27.1 2026-08-11, 0.28.0 2026-08-26, "
    "0.29.0 2026-09-09, 0.30.0 2026-09-22, 0.31.0 2026-10-05, 0.32.0 2026-10-18, 0.33.0 2026-11-02")

DS = "vllm/model_executor/models/deepseek_v2.py"
INTERFACES = "vllm/model_executor/models/interfaces.py"
_DEFAULTS = Cited(Defaults.BEFORE_2_MID_LAST3, Source(REPO, INTERFACES, "v0.33.0",
                  "get_eagle3_default_aux_hidden_state_layers() returns (2, num_layers // 2, num_layers - 3)"))
_MRV1 = Source(REPO, "vllm/v1/worker/gpu_model_runner.py", "v0.25.0",
               "_get_eagle3_aux_layers_from_config: top-level eagle_aux_hidden_state_layer_ids, else dflash_config"
               ".target_layer_ids + 1, overridden by eagle_config.eagle_aux_hidden_state_layer_ids when eagle_config "
               "is present; an empty list is falsy: the model default; eagle_config.use_aux_hidden_state false turns "
               "capture off (llm_base_proposer.py)")
_V2_DEFAULT = Source(REPO, "vllm/config/vllm.py", "v0.24.0",
                     "use_v2_model_runner: runner v2 by default for DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES "
                     "(Qwen3ForCausalLM, DeepseekV2ForCausalLM, Qwen2MoeForCausalLM, GraniteMoeForCausalLM, "
                     "LlamaForCausalLM, MistralForCausalLM); 0.25.0 adds every non-MoE model; DeepseekV3ForCausalLM "
                     "(V3, Kimi-K2) is MoE and not listed: runner v1")
CONFIG_V1 = Cited(ConfigRead((ConfigKey(TOP), ConfigKey(NESTED), ConfigKey(("dflash_config", "target_layer_ids"), 1)),
                             Empty.DEFAULT, OFF_FLAG), _MRV1)
CONFIG_V2 = Cited(ConfigRead((ConfigKey(TOP), ConfigKey(("dflash_config", "target_layer_ids"), 1)), Empty.DEFAULT,
                             OFF_FLAG),
                  Source(REPO, "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "v0.24.0",
                         "get_eagle3_aux_layers_from_config (model runner v2): top-level key, then dflash target "
                         "ids + 1; the nested eagle_config key is not read"))
RUNNER_V2 = Change((), "model runner v2 the default for this architecture", None, "0.24.0",
                   {"config": CONFIG_V2})

# --pipeline-parallel-size: before the PP aux handoff, a stage other than the last returns IntermediateTensors with
# hidden_states and residual only (#45985, open, describes it); #50514 (merged) carries the aux states to the last
# stage, on model runner v2 only. Its merge date and first release are not known here: the change is in `latest` only.
PP_DROPPED = Cited(Handoff.LAST_STAGE_ONLY, Source(
    REPO, "", "#45985", "(open) 'auxiliary hidden states ... residing on non-last PP ranks are silently discarded "
    "-- the drafter receives fewer aux states than expected and combine_hidden_states fails with a k-axis shape "
    "mismatch': every EAGLE-3 model's forward returns IntermediateTensors({hidden_states, residual}) on non-last "
    "ranks (llama.py, deepseek_v2.py)"))
PP_HANDOFF = Change(("#50514",), "EAGLE-3 aux hidden states handed to the last PP stage (model runner v2)", None,
                    None, {"pp": Cited(Handoff.HANDOFF, Source(
                        REPO, "", "#50514", "(merged) '[Core][MRV2] Support eagle3 spec decode with pipeline "
                        "parallel': the stage before the last sends its aux taps with its IntermediateTensors, stages "
                        "further back isend them straight to the last rank, which receives them into buffers shaped "
                        "like its hidden states; model runner v2 only; merge date and first release unknown here"))})

_loop = Source(REPO, DS, "v0.24.0",
               "before layer idx, `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + "
               "residual)`, no `residual is not None` guard (residual is None before layer 0); states in layer order")
def _deepseek(family: str, models: tuple[str, ...], changes: tuple[Change, ...], note: str) -> Line:
    return Line(
        "vllm", family, models,
        Behaviour(numbering=Cited(Numbering.BEFORE_LAYER, _loop), defaults=_DEFAULTS,
                  embed=Cited(EmbedId.CRASHES, _loop), out_of_range=Cited(OutOfRange.DROPPED, _loop),
                  order=Cited(Order.ASCENDING, _loop), duplicates=Cited(Duplicates.CAPTURED_ONCE, _loop),
                  config=CONFIG_V1, site=Cited(Site.BETWEEN_LAYERS, _loop), cloned=Cited(False, _loop), pp=PP_DROPPED,
                  last_boundary=Cited(False, Source(REPO, "", "#46973", "before it, an id of num_hidden_layers "
                                                    "matched no iteration and was silently dropped")),
                  scattered=Cited(Gather.GATHERED, Source(REPO, DS, "002d6073",
                                  "with sequence-parallel MoE the capture all-gathers when hidden_states.shape[0] "
                                  "!= positions.shape[0]"))),
        starts=Change((), "EAGLE-3 capture in deepseek_v2.py", None, "0.18.0", {}),
        changes=changes,
        notes=("id 0 still adds residual=None in every version read (0.18.0 .. 0.33.0); PR #46788, which would "
               "have moved DeepSeek onto EagleModelMixin, was closed unmerged",
               "0.24.0 was published two days after #46973 was reviewed and does not contain it", note),
    )


FINAL_LAYER = Change(("#46973",), "capture the final layer's output (id L)", None, "0.25.0",
                     {"last_boundary": Cited(True, Source(REPO, DS, "v0.25.0",
                                             "after the loop, `if self.end_layer in self.aux_hidden_state_layers`: "
                                             "hidden_states + residual, before the final norm"))})
DEEPSEEK_V2 = _deepseek("deepseek_v2", ("deepseek_v2",), (RUNNER_V2, FINAL_LAYER, PP_HANDOFF),
                        "DeepseekV2ForCausalLM (V2, V2-Lite) runs on model runner v2 by default from 0.24.0 (the "
                        "first release read; it may be earlier), which reads only the top-level key")
DEEPSEEK_V3 = _deepseek("deepseek_v3", ("deepseek_v3", "kimi_k2"), (FINAL_LAYER,),
                        "DeepseekV3ForCausalLM (V3, Kimi-K2) is MoE and not on runner v2's default list: runner v1 "
                        "reads the nested eagle_config key when there is no top-level one")


_MIXIN = Source(REPO, INTERFACES, "v0.25.0",
                "EagleModelMixin._maybe_add_hidden_state: `hidden_states + residual if residual is not None else "
                "hidden_states`, called with 0 before the loop and idx + 1 after each layer (id L: the last layer's "
                "output, before the final norm)")
MIXIN_BASE = Behaviour(numbering=Cited(Numbering.BEFORE_LAYER, _MIXIN), defaults=_DEFAULTS,
                       embed=Cited(EmbedId.CAPTURED, _MIXIN), out_of_range=Cited(OutOfRange.DROPPED, _MIXIN),
                       order=Cited(Order.ASCENDING, _MIXIN), duplicates=Cited(Duplicates.CAPTURED_ONCE, _MIXIN),
                       config=CONFIG_V1, site=Cited(Site.BETWEEN_LAYERS, _MIXIN), cloned=Cited(False, _MIXIN), pp=PP_DROPPED,
                       last_boundary=Cited(True, _MIXIN))
MIXIN_STARTS = Change(("#36063",), "EagleModelMixin (capture the last layer's output too)", None, "0.18.0", {})

MIXIN_DENSE = Line(
    "vllm", "llama", ("llama", "qwen2", "qwen3", "mistral"), MIXIN_BASE, starts=MIXIN_STARTS,
    changes=(RUNNER_V2, PP_HANDOFF),
    notes=("runner v2 is the default for Llama, Qwen3 and Mistral from 0.24.0 (the first release read; it may be "
           "earlier) and for Qwen2 from 0.25.0; VLLM_USE_V2_MODEL_RUNNER=0 brings back runner v1, which reads the "
           "nested key",),
)

MIXIN_MOE = Line(
    "vllm", "qwen3_moe", ("qwen3_moe", "gpt_oss", "minimax_m2"), MIXIN_BASE, starts=MIXIN_STARTS,
    notes=("MoE models not on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES run on runner v1, which reads the nested key",
           "MiniMax-M2: PR #43671 (open) says its ids are off by one against SGLang-trained heads"),
)

LINES = (DEEPSEEK_V2, DEEPSEEK_V3, MIXIN_DENSE, MIXIN_MOE)
