"""SGLang's server side, which every model file's profile shares: the releases (their dates, and which
wheels were read), `src` for citing the released code, and the behaviours outside the model files (the
draft config read, the CUDA graphs' start-up order, the pipeline-parallel start-up check, the
all-reduce fusion auto-enable rule), with `COMMON_START`/`COMMON`, the state and changes every model
file starts from.

Every release from 0.5.6 to 0.5.23 was downloaded and the cited code compared; each change names the
first release whose wheel has it (`.post` releases and release candidates were not read). Merge
commits of the PRs are not known here (the repository was too large to read).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import date

from tpsim.profiles.cited import Change, Cited, Source, releases
from tpsim.profiles.profile import NESTED, OFF_FLAG, ConfigKey, ConfigRead, Empty, FusionAuto, GraphIds, Handoff

REPO = "sgl-project/sglang"
RELEASES = releases(
    "0.4.0 2024-12-03, 0.4.0.post1 2024-12-06, 0.4.0.post2 2024-12-21, 0.4.1 2024-12-25, "
    "0.4.1.post1 2024-12-27, 0.4.1.post2 2024-12-29, 0.4.1.post3 2024-12-29, 0.4.1.post4 2025-01-05, "
    "0.4.1.post5 2025-01-11, 0.4.1.post6 2025-01-15, 0.4.1.post7 2025-01-20, 0.4.2 2025-01-27, "
    "0.4.2.post1 2025-01-31, 0.4.2.post2 2025-02-05, 0.4.2.post3 2025-02-07, 0.4.2.post4 2025-02-10, "
    "0.4.3 2025-02-14, 0.4.3.post1 2025-02-17, 0.4.3.post2 2025-02-17, 0.4.3.post3 2025-03-06, "
    "0.4.3.post4 2025-03-06, 0.4.4 2025-03-13, 0.4.4.post1 2025-03-14, 0.4.4.post2 2025-03-27, "
    "0.4.4.post3 2025-03-29, 0.4.4.post4 2025-04-05, 0.4.5 2025-04-07, 0.4.5.post1 2025-04-16, "
    "0.4.5.post2 2025-04-20, 0.4.5.post3 2025-04-22, 0.4.6 2025-04-27, 0.4.6.post1 2025-04-28, "
    "0.4.6.post2 2025-05-01, 0.4.6.post3 2025-05-09, 0.4.6.post4 2025-05-13, 0.4.6.post5 2025-05-24, "
    "0.4.7 2025-06-10, 0.4.7.post1 2025-06-16, 0.4.8 2025-06-24, 0.4.8.post1 2025-06-26, "
    "0.4.9 2025-07-06, 0.4.9.post1 2025-07-09, 0.4.9.post2 2025-07-12, 0.4.9.post3 2025-07-22, "
    "0.4.9.post4 2025-07-26, 0.4.9.post5 2025-07-28, 0.4.9.post6 2025-07-29, 0.4.10 2025-07-31, "
    "0.4.10.post1 2025-08-01, 0.4.10.post2 2025-08-03, 0.5.0rc0 2025-08-08, 0.5.0rc1 2025-08-13, "
    "0.5.0rc2 2025-08-14, 0.5.1 2025-08-23, 0.5.1.post1 2025-08-24, 0.5.1.post2 2025-08-25, "
    "0.5.1.post3 2025-08-27, 0.5.2rc0 2025-09-01, 0.5.2rc1 2025-09-02, 0.5.2rc2 2025-09-05, "
    "0.5.2 2025-09-11, 0.5.3rc0 2025-09-15, 0.5.3rc2 2025-10-06, 0.5.3 2025-10-06, "
    "0.5.3.post1 2025-10-09, 0.5.3.post2 2025-10-15, 0.5.3.post3 2025-10-16, 0.5.4 2025-10-24, "
    "0.5.4.post1 2025-10-27, 0.5.4.post2 2025-11-01, 0.5.4.post3 2025-11-05, 0.5.5 2025-11-06, "
    "0.5.5.post1 2025-11-10, 0.5.5.post2 2025-11-12, 0.5.5.post3 2025-11-17, 0.5.6 2025-12-03, "
    "0.5.6.post1 2025-12-08, 0.5.6.post2 2025-12-11, 0.5.7 2026-01-01, 0.5.8 2026-01-23, "
    "0.5.8.post1 2026-02-05, 0.5.9 2026-02-23, 0.5.10rc0 2026-03-27, 0.5.10 2026-04-05, "
    "0.5.10.post1 2026-04-08, 0.5.11 2026-05-05, 0.5.12 2026-05-16, 0.5.12.post1 2026-05-23, "
    "0.5.13 2026-06-11, 0.5.13.post1 2026-06-15, 0.5.14 2026-06-26, 0.5.15 2026-07-10, "
    "0.5.15.post1 2026-07-14, 0.5.16 2026-07-25, 0.5.17 2026-08-08, 0.5.18 2026-08-21, "
    "0.5.19 2026-09-04, 0.5.20 2026-09-18, 0.5.21 2026-10-01, 0.5.22 2026-10-16, 0.5.23 2026-10-30")
# the releases whose wheels were read (every one from the oldest profiled to the newest)
READ = ("0.5.6", "0.5.7", "0.5.8", "0.5.9", "0.5.10", "0.5.11", "0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16",
        "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")

OLDEST = Change((), "the oldest release read", None, "0.5.6", {})


def src(path: str, ref: str, symbol: str, quote: str, note: str, reviewed: tuple[str, ...] = ()) -> Source:
    """`reviewed`: later releases whose changed `symbol` was read (the fingerprint differs, the behaviour holds)."""
    return Source(REPO, f"python/sglang/srt/{path}", ref, note, symbol, quote, reviewed)


POST_056 = ("0.5.6.post1", "0.5.6.post2")


SERVER_ARGS = "server_args.py"
HOOK = "arg_groups/validation_hook.py"

# --- the draft config read (model runner) --------------------------------------------------------

_READ_NOTE = ("eagle_config['eagle_aux_hidden_state_layer_ids'] read inside a bare try/except that sets None (the "
              "default); eagle_config.get('use_aux_hidden_state', True) false skips set_eagle3_layers_to_capture; a "
              "top-level key is not read; [] gives layers_to_capture = [] with capture on, and the ForCausalLM's "
              "`hidden_states, aux_hidden_states = hidden_states` unpack fails (inferred from the code)")
_READ_QUOTE = ("eagle_config[ \"eagle_aux_hidden_state_layer_ids\" ] except: # if there is no aux layer, set to None")
RUNNER = src("model_executor/model_runner.py", "v0.5.6", "ModelRunner.initialize",
             "eagle_aux_hidden_state_layer_ids = " + _READ_QUOTE,
             "after init_device_graphs(): " + _READ_NOTE.replace("; eagle_config.get('use_aux_hidden_state', True) "
                                                                 "false skips set_eagle3_layers_to_capture", "")
             + "; use_aux_hidden_state is not read: capture is always on (0.5.6, 0.5.7)",
             reviewed=(*POST_056, "0.5.7"))
CONFIG = Cited(ConfigRead((ConfigKey(NESTED),), Empty.CRASH), RUNNER)
CONFIG_058 = Cited(ConfigRead((ConfigKey(NESTED),), Empty.CRASH, OFF_FLAG), src(
    "model_executor/model_runner.py", "v0.5.8", "ModelRunner.__init__",
    "self.eagle_use_aux_hidden_state = eagle_config.get( \"use_aux_hidden_state\", True ) "
    "self.eagle_aux_hidden_state_layer_ids = " + _READ_QUOTE, _READ_NOTE + " (the same read in 0.5.9 .. 0.5.15.post1; "
    "0.5.14 nests it under `if self.spec_algorithm.is_eagle3():` inside a branch for EAGLE drafts with a draft path)",
    reviewed=("0.5.9", "0.5.10rc0", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13",
              "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1")))
CONFIG_0516 = Cited(CONFIG_058.value, src(
    "model_executor/model_runner_components/spec_aux_hidden_state.py", "v0.5.16", "_resolve_eagle_aux_hidden_state",
    "config.eagle_aux_hidden_state_layer_ids = " + _READ_QUOTE,
    "the same read moved out of ModelRunner (re-read at 0.5.23: `except Exception:`, the same fallback); "
    + _READ_NOTE))

# --- CUDA graphs (#22836) ------------------------------------------------------------------------

GRAPHS_BEFORE = Cited(GraphIds.DEFAULT, src(
    "model_executor/cuda_graph_runner.py", "v0.5.6", "CudaGraphRunner.__init__",
    "# Speculative_inference if model_runner.spec_algorithm.is_eagle3(): "
    "self.model_runner.model.set_eagle3_layers_to_capture()",
    "the graph runner sets the capture with no ids (the default) before capturing graphs; ModelRunner.initialize "
    "sets the configured ids only after init_device_graphs(), so graphed batches capture the default ids",
    reviewed=(*POST_056, "0.5.7")))
GRAPHS_BEFORE_058 = Cited(GraphIds.DEFAULT, src(
    "model_executor/cuda_graph_runner.py", "v0.5.8", "CudaGraphRunner.__init__",
    "model_runner.spec_algorithm.is_eagle3() and model_runner.eagle_use_aux_hidden_state ): "
    "self.model_runner.model.set_eagle3_layers_to_capture()",
    "the graph runner sets the capture with no ids (the default) before capturing graphs; ModelRunner.initialize "
    "sets the configured ids only after init_device_graphs(), so graphed batches capture the default ids "
    "(the same in 0.5.8 .. 0.5.10.post1, now also gated on use_aux_hidden_state; PR #22836 moved it)",
    reviewed=("0.5.10rc0", "0.5.10", "0.5.10.post1")))
GRAPHS_FIXED = Change(("#22836",), "capture set before CUDA graphs are captured", date(2026, 4, 15), "0.5.11",
                      {"graphs": Cited(GraphIds.CONFIG, src(
                          "model_executor/model_runner.py", "v0.5.11", "ModelRunner.initialize",
                          "# Must be called BEFORE init_device_graphs() so CUDA graph capture # runs with aux hidden "
                          "state capture enabled. self.init_aux_hidden_state_capture()",
                          "init_aux_hidden_state_capture() runs before init_device_graphs() (re-read at 0.5.23: "
                          "ModelRunner.init_attention_backends calls configure_aux_hidden_state_capture before any "
                          "graph capture, model_runner_components/attention_backend_setup.py; in 0.5.14 .. 0.5.15.post1 the same "
                          "call under the same comment is in ModelRunner.init_attention_backends, before "
                          "init_decode_cuda_graph())",
                          reviewed=("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15",
                                    "0.5.15.post1")))})

GRAPHS_0516 = Cited(GraphIds.CONFIG, src(
    "model_executor/model_runner.py", "v0.5.16", "ModelRunner.init_attention_backends",
    "# Must be called BEFORE init_decode_cuda_graph() so CUDA graph capture # runs with aux hidden state capture "
    "enabled. configure_aux_hidden_state_capture(",
    "the capture set moved into init_attention_backends, still before any graph is captured (the same at 0.5.23)"))

# --- pipeline parallelism: the start-up check refuses EAGLE-3 in every release read ----------------

_PP_EARLY = ("the model files' own early return on a stage other than the last (llama.py at 00239548: `if not "
             "self.pp_group.is_last_rank: return PPProxyTensors(...)`) is never reached with EAGLE-3 in a release")
PP_0506 = Cited(Handoff.REFUSED, src(
    SERVER_ARGS, "v0.5.6", "ServerArgs.check_server_args",
    "if self.pp_size > 1: assert ( self.disable_overlap_schedule and self.speculative_algorithm is None and not "
    "self.enable_mixed_chunk ), \"Pipeline parallelism is not compatible with overlap schedule, speculative "
    "decoding, mixed chunked prefill.\"",
    "--pp-size > 1 with any --speculative-algorithm fails the start-up check (the same in 0.5.6 .. 0.5.10); "
    + _PP_EARLY, reviewed=("0.5.7", "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10rc0", "0.5.10", "0.5.10.post1")),
    "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding, mixed "
    "chunked prefill.")
_PP_TEXT = "AssertionError: Pipeline parallelism is not compatible with overlap schedule, speculative decoding"
PP_0511 = Cited(Handoff.REFUSED, src(
    SERVER_ARGS, "v0.5.11", "ServerArgs.check_server_args",
    "if self.pp_size > 1: assert ( self.disable_overlap_schedule and self.speculative_algorithm is None ), "
    "\"Pipeline parallelism is not compatible with overlap schedule, speculative decoding\"",
    "mixed chunked prefill no longer in the assert; speculative decoding still refused (the same in 0.5.11 .. "
    "0.5.18)", reviewed=("0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1",
                         "0.5.16", "0.5.17", "0.5.18")), _PP_TEXT)
PP_0519 = Cited(Handoff.REFUSED, src(
    HOOK, "v0.5.19", "check_server_args",
    "if cfg.pp_size > 1: assert ( cfg.disable_overlap_schedule and cfg.speculative_algorithm is None ), "
    "\"Pipeline parallelism is not compatible with overlap schedule, speculative decoding\"",
    "the server-args checks moved to arg_groups/validation_hook.py; the same assert"), _PP_TEXT)
PP_0520 = Cited(Handoff.REFUSED, src(
    HOOK, "v0.5.20", "check_server_args",
    "# Non-NPU: PP + speculative decoding is not supported assert cfg.disable_overlap_schedule and "
    "cfg.speculative_algorithm is None, ( \"Pipeline parallelism is not compatible with overlap schedule, "
    "speculative decoding\" )",
    "NPU alone may run PP with EAGLE (not EAGLE-3) on prefill nodes; every other platform keeps the assert "
    "(tpsim's GPUs are not NPUs)"), _PP_TEXT)
PP_0521 = Cited(Handoff.REFUSED, src(
    HOOK, "v0.5.21", "check_pipeline_parallel_compat",
    "elif cfg.speculative_algorithm is not None: assert ( cfg.speculative_algorithm.upper() == \"EAGLE\" and not "
    "cfg.enable_multi_layer_eagle ), ( \"Pipeline parallelism currently only supports EAGLE \" "
    "\"(non-multi-layer) speculative decoding\" )",
    "the old assert is gone: PP runs EAGLE (and DSPARK on prefill nodes) but EAGLE-3 is still refused at "
    "start-up, `EAGLE3`.upper() != 'EAGLE' (the same in 0.5.22 and 0.5.23)"),
    "AssertionError: Pipeline parallelism currently only supports EAGLE (non-multi-layer) speculative decoding")

# --- FlashInfer all-reduce fusion auto-enable (DeepseekV3ForCausalLM, GptOss, Qwen3Moe; never DeepseekV2) -------

FUSION_V3_056 = Cited(FusionAuto.SM100, src(
    SERVER_ARGS, "v0.5.6", "ServerArgs._handle_model_specific_adjustments",
    "# workaround for https://github.com/flashinfer-ai/flashinfer/issues/2006 if not self.enable_dp_attention and "
    "self.nnodes == 1: self.enable_flashinfer_allreduce_fusion = True",
    "inside `if model_arch in [\"DeepseekV3ForCausalLM\"]:` and `if is_cuda() and is_sm100_supported():`; "
    "no tp_size term (tp 1 has no all-reduce to fuse: tpsim's rule needs tp > 1, the same capture); 0.5.6.post1 "
    "adds MistralLarge3/Pixtral to the DeepSeek branch, the same rule", reviewed=POST_056))
FUSION_057 = Cited(FusionAuto.SM90_SM100_NOT_H20, src(
    SERVER_ARGS, "v0.5.7", "ServerArgs._handle_model_specific_adjustments",
    "and (is_sm90_supported() or is_blackwell_supported()) and not self.enable_dp_attention and self.nnodes == 1 "
    "and not is_h20_device and self.moe_a2a_backend == \"none\" ): self.enable_flashinfer_allreduce_fusion = True",
    "for DeepseekV3ForCausalLM, GptOssForCausalLM, Glm4MoeForCausalLM, Qwen3MoeForCausalLM (not "
    "DeepseekV2ForCausalLM); no tp_size > 1 term until 0.5.10 (tp 1 has no all-reduce to fuse: the same capture); "
    "0.5.8 narrowed Blackwell to is_sm100_supported()"))
FUSION_058 = Cited(FusionAuto.SM90_SM100_NOT_H20, src(
    SERVER_ARGS, "v0.5.8", "ServerArgs._handle_model_specific_adjustments",
    "and (is_sm90_supported() or is_sm100_supported()) and not self.enable_dp_attention and self.nnodes == 1 "
    "and not is_h20_device", "Blackwell narrowed to is_sm100_supported() (the same in 0.5.8, 0.5.9; 0.5.10rc0 adds "
    "`self.attn_cp_size <= 1` and --enforce-disable-flashinfer-allreduce-fusion, off by default, as 0.5.10 has)",
    reviewed=("0.5.9", "0.5.10rc0")))
FUSION_0510 = Cited(FusionAuto.SM90_SM100_NOT_H20, src(
    SERVER_ARGS, "v0.5.10", "ServerArgs._handle_model_specific_adjustments",
    "and (is_sm90_supported() or is_sm100_supported()) and self.tp_size > 1 and not self.enable_dp_attention",
    "the tp_size > 1 term joins the rule; H20 still excluded (the same in 0.5.11 .. 0.5.12.post1: the "
    "attn_cp_size term dropped, more architectures listed)", reviewed=("0.5.11", "0.5.12", "0.5.12.post1")))
FUSION_0513 = Cited(FusionAuto.SM90_SM100, src(
    SERVER_ARGS, "v0.5.13", "ServerArgs._handle_model_specific_adjustments",
    "and self.tp_size > 1 and not self.enable_dp_attention and self.nnodes == 1 and self.moe_a2a_backend == "
    "\"none\"", "the H20 exclusion is gone"))
FUSION_0514 = Cited(FusionAuto.SM90_SM100_MULTINODE_SM100, src(
    SERVER_ARGS, "v0.5.14", "ServerArgs._handle_model_specific_adjustments",
    "and not self.enable_dp_attention and (self.nnodes == 1 or is_sm100_supported()) and self.moe_a2a_backend == "
    "\"none\" ): self.flashinfer_allreduce_fusion_backend = \"auto\"",
    "flashinfer_allreduce_fusion_backend='auto'; nnodes == 1 or SM100 (PR #28789 restored SM90)"))
FUSION_0515 = Cited(FusionAuto.SM90_SM100_MULTINODE_SM100, src(
    "arg_groups/overrides.py", "v0.5.15", "_flashinfer_allreduce_fusion_auto_enable",
    "and view.tp_size > 1 and not view.enable_dp_attention and (view.nnodes == 1 or is_sm100_supported()) and "
    "view.moe_a2a_backend == \"none\"",
    "the rule moved to a post-process hook over _FLASHINFER_ALLREDUCE_FUSION_ARCHS (re-read at 0.5.23: "
    "get_platform().is_sm90/is_sm100, attn_dp_enabled_of(view), the same conditions; DeepseekV2ForCausalLM, "
    "LlamaForCausalLM, Qwen2/Qwen3ForCausalLM still not listed)"))
FUSION_0519 = Cited(FusionAuto.SM90_SM100_MULTINODE_SM100, src(
    "arg_groups/overrides.py", "v0.5.19", "_flashinfer_allreduce_fusion_auto_enable",
    "and (get_platform().is_sm90 or get_platform().is_sm100) and view.tp_size > 1 and not view.enable_dp_attention "
    "and (view.nnodes == 1 or get_platform().is_sm100)",
    "the platform read through get_platform(); the same conditions (0.5.23: attn_dp_enabled_of(view) and a "
    "DeepSeek-V4.1 exception, the same for V3)"))
FUSION_NEVER_V2 = Cited(FusionAuto.NEVER, src(
    SERVER_ARGS, "v0.5.6", "ServerArgs._handle_model_specific_adjustments",
    "if model_arch in [\"DeepseekV3ForCausalLM\"]: if is_deepseek_nsa(hf_config):",
    "DeepSeek's rule is for DeepseekV3ForCausalLM only; DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite) is on no "
    "auto-enable list in any release read, 0.5.6 .. 0.5.23 (0.5.6.post1 adds MistralLarge3/Pixtral to the branch, "
    "not DeepseekV2ForCausalLM)", reviewed=POST_056))


# what every model file does at the oldest release read: the config read, the graphs' ids, the PP refusal
COMMON_START = {"config": CONFIG, "graphs": GRAPHS_BEFORE, "pp": PP_0506}


# the changes every model file shares: the config read and the start-up check
COMMON = (Change((), "use_aux_hidden_state read: false turns capture off", None, "0.5.8",
                  {"config": CONFIG_058, "graphs": GRAPHS_BEFORE_058}),
           replace(GRAPHS_FIXED, title=GRAPHS_FIXED.title + "; PP refusal without mixed chunked prefill",
                   changes={**GRAPHS_FIXED.changes, "pp": PP_0511}),
           Change((), "config read moved to spec_aux_hidden_state.py; the capture set in init_attention_backends",
                  None, "0.5.16", {"config": CONFIG_0516, "graphs": GRAPHS_0516}),
           Change((), "PP refusal moved to arg_groups/validation_hook.py", None, "0.5.19", {"pp": PP_0519}),
           Change((), "PP refusal: an NPU-only branch beside it", None, "0.5.20", {"pp": PP_0520, "config": Cited(
               CONFIG_058.value, src("model_executor/model_runner_components/spec_aux_hidden_state.py", "v0.5.20",
                                     "_resolve_eagle_aux_hidden_state", "config.eagle_aux_hidden_state_layer_ids = "
                                     "eagle_config[ \"eagle_aux_hidden_state_layer_ids\" ] except Exception: "
                                     "config.eagle_aux_hidden_state_layer_ids = None",
                                     "`except Exception:` for the bare except; the same fallback (the same at "
                                     "0.5.23); " + _READ_NOTE))}),
           Change((), "PP: only EAGLE (non-multi-layer) accepted; EAGLE-3 still refused", None, "0.5.21",
                  {"pp": PP_0521}))
