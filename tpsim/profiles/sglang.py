"""SGLang's profiles: DeepSeek-V2/V3 (and Kimi-K2), Llama, Qwen2/Qwen3, Qwen3-MoE and GPT-OSS model
files, from 0.5.6 on, each behaviour read from the released code (the PyPI wheel of the version
named in the source) or the PR that changed it.

Merge commits of the PRs are not known here (the repository snapshot was too large to read), so
each change names its PR and the first release whose wheel has the code.
"""

from __future__ import annotations

from datetime import date

from tpsim.profiles.profile import (NESTED, OFF_FLAG, Behaviour, Change, Cited, ConfigKey, ConfigRead, Defaults,
                                    Duplicates, EmbedId, Empty, FusionAuto, Gather, GraphIds, Handoff, Line, Numbering,
                                    Order, OutOfRange, Site, Source, TboCapture, releases)

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


OLDEST = Change((), "the oldest release read", None, "0.5.6", {})


def src(path: str, ref: str, note: str) -> Source:
    return Source(REPO, f"python/sglang/srt/{path}", ref, note)


DS = "models/deepseek_v2.py"
RUNNER = src("model_executor/model_runner.py", "v0.5.12",
             "eagle_config['eagle_aux_hidden_state_layer_ids'] read inside a bare try/except that sets None "
             "(the default); eagle_config.get('use_aux_hidden_state', True) false skips set_eagle3_layers_to_capture; "
             "a top-level key is not read; [] gives layers_to_capture = [] with capture on, and the "
             "ForCausalLM's `hidden_states, aux_hidden_states = hidden_states` unpack fails (inferred from the code)")
CONFIG = Cited(ConfigRead((ConfigKey(NESTED),), Empty.CRASH, OFF_FLAG), RUNNER)
GRAPHS_BEFORE = Cited(GraphIds.DEFAULT, Source(REPO, "python/sglang/srt/model_executor/cuda_graph_runner.py", "#22836",
                      "before the PR, set_eagle3_layers_to_capture ran after graph capture; CudaGraphRunner's "
                      "workaround called it with no ids, so graphed batches captured the default ids"))
GRAPHS_FIXED = Change(("#22836",), "capture set before CUDA graphs are captured", date(2026, 4, 15), "0.5.11",
                      {"graphs": Cited(GraphIds.CONFIG, src("model_executor/model_runner.py", "v0.5.11",
                                      "init_aux_hidden_state_capture() runs before init_device_graphs()"))})
SERVER_ARGS = "server_args.py"
# --pp-size: every model file's capture ends on a stage other than the last. Read in llama.py at 00239548 (no
# release tag known for that commit); PR #39644 (open) says the same of every EAGLE-3 target model file.
PP_EARLY_RETURN = Cited(Handoff.LAST_STAGE_ONLY, src(
    "models/llama.py", "00239548f1cd1a06ca145a5447a86738090a48f1",
    "LlamaModel.forward: `if not self.pp_group.is_last_rank: return PPProxyTensors({'hidden_states': ..., "
    "'residual': ...})`, the aux_hidden_states of the stage's own layers not included; and "
    "set_eagle3_layers_to_capture returns at once `if not self.pp_group.is_last_rank`; PR #39644 (open, "
    "'Reject EAGLE3/DFLASH aux hidden-state capture under pipeline parallelism') says every target model file "
    "returns early on stages other than the last, so the draft gets only the last stage's slots"))
FUSION_057 = Cited(FusionAuto.SM90_SM100_NOT_H20, src(SERVER_ARGS, "v0.5.7",
                   "flashinfer all-reduce fusion on for DeepseekV3/GptOss/Glm4Moe/Qwen3Moe when SM90 or Blackwell, "
                   "not DP attention, nnodes == 1, not H20, moe_a2a_backend == 'none' (commit 1ab9b8e0a; PR #16283, "
                   "after 0.5.7, narrowed Blackwell to SM100)"))
FUSION_0513 = Cited(FusionAuto.SM90_SM100, src(SERVER_ARGS, "v0.5.13", "the H20 exclusion is gone"))
FUSION_0514 = Cited(FusionAuto.SM90_SM100_MULTINODE_SM100, src(SERVER_ARGS, "v0.5.14",
                    "flashinfer_allreduce_fusion_backend='auto'; nnodes == 1 or SM100 (PR #28789 restored SM90)"))


def _loop(path: str, ref: str, guarded: bool) -> dict:
    """The model-level capture loop shared by the model files before 0.5.14: `hidden_states +
    residual` before layer i for i in start..end (the add makes a new tensor)."""
    loop = src(path, ref, "before layer i, `if i in self.layers_to_capture: aux_hidden_states.append(hidden_states"
               " + residual)`" + (" (residual None at layer 0: the hidden states alone)" if guarded else
                                  "; residual is None before layer 0") + "; the loop runs start_layer..end_layer")
    return dict(
        embed=Cited(EmbedId.CAPTURED if guarded else EmbedId.CRASHES, loop),
        out_of_range=Cited(OutOfRange.DROPPED, loop), order=Cited(Order.ASCENDING, loop),
        duplicates=Cited(Duplicates.CAPTURED_ONCE, loop), site=Cited(Site.BETWEEN_LAYERS, loop),
        cloned=Cited(False, loop), last_boundary=Cited(False, loop))


def _setter(path: str, ref: str) -> dict:
    s = src(path, ref, "set_eagle3_layers_to_capture: None -> [2, n//2, n-3]; ids -> [val + 1 for val in layer_ids] "
                       "(\"for the ith layer, it takes the output of the (i-1)th layer\")")
    return dict(numbering=Cited(Numbering.OUTPUT_OF_PLUS_ONE, s), defaults=Cited(Defaults.BEFORE_2_MID_LAST3, s))


# two-batch overlap: read at one commit whose release is not known; no change to it is known (PR #32680 closed)
TBO = Cited(TboCapture.REGION_NOT_CAPTURED, src(
    DS, "3e4a39ee73308590c5c753108bdcb8d333f7f1c6",
    "DeepseekV2Model.forward: `if forward_batch.can_run_tbo:` (and start_layer < first_k_dense_replace < end_layer) "
    "`normal_end_layer = self.first_k_dense_replace`; the capture loop is `for i in range(normal_start_layer, "
    "normal_end_layer)`, the remaining layers run in model_forward_maybe_tbo after it, so no boundary >= "
    "first_k_dense_replace is captured (the same structure at 00114aef; PR #32680, closed unmerged, reports "
    "'0 of 3 layers captured' on DeepSeek-V2-Lite). Which releases have it: not established beyond these commits"))

DEEPSEEK = Line(
    "sglang", "deepseek_v2", ("deepseek_v2", "deepseek_v3", "kimi_k2"),
    Behaviour(**_setter(DS, "v0.5.6"), **_loop(DS, "v0.5.6", guarded=False), config=CONFIG, pp=PP_EARLY_RETURN, graphs=GRAPHS_BEFORE,
              fusion_auto=Cited(FusionAuto.SM100, src(SERVER_ARGS, "v0.5.6",
                                "fusion auto-enabled for DeepSeek only on SM100, not DP attention, nnodes == 1")),
              scattered=Cited(Gather.LOCAL, src(DS, "v0.5.6", "under DeepEP the stream between MoE layers is "
                                                "token-scattered and the capture adds the local shard")),
              tbo=TBO),
    starts=OLDEST,
    changes=(
        Change(("#14280", "1ab9b8e0a"), "DeepEP capture all-gathered; fusion auto-enabled on SM90", None,
               "0.5.7", {"scattered": Cited(Gather.GATHERED, src(DS, "v0.5.7",
                        "`if self.enable_a2a_moe and i > self.first_k_dense_replace`: all-gather hidden_states + "
                        "residual over the attention-TP group before capture")), "fusion_auto": FUSION_057}),
        GRAPHS_FIXED,
        Change(("#25454",), "+1 only when the first id is 1", date(2026, 5, 16), "0.5.13",
               {"numbering": Cited(Numbering.PLUS_ONE_IF_FIRST_IS_1, src(DS, "v0.5.13",
                              "`if layer_ids and layer_ids[0] == 1: [val + 1 ...] else: list(layer_ids)`")),
                "fusion_auto": FUSION_0513}),
        Change(("#28343", "#28789"), "capture after the fused all-reduce + add, in the decoder layer",
               None, "0.5.14",
               {"site": Cited(Site.AFTER_FUSED_ADD, c := src(DS, "v0.5.14",
                        "the loop passes captured_last_layer_outputs into the decoder layer; "
                        "prepare_attn_and_capture_last_layer_outputs appends the residual after prepare_attn "
                        "(fused all-reduce + add + norm), cloned unless read-only; residual None -> hidden_states")),
                "cloned": Cited(True, c), "embed": Cited(EmbedId.CAPTURED, c), "fusion_auto": FUSION_0514}),
    ),
    notes=("#28343's merge commit is not known; 0.5.14 is the first wheel with the decoder-layer capture, which "
           "matches the PR's description (Kimi K2.5, AR fusion at tp > 1)",
           "two-batch overlap (forward_batch.can_run_tbo) runs layers from first_k_dense_replace on outside the "
           "capture loop: nothing there is captured (behaviour `tbo`; tpsim check --tbo replays it)"),
)

LLAMA = Line(
    "sglang", "llama", ("llama", "mistral"),
    Behaviour(**_setter("models/llama.py", "v0.5.12"), **_loop("models/llama.py", "v0.5.12", guarded=False),
              config=CONFIG, pp=PP_EARLY_RETURN, graphs=GRAPHS_BEFORE,
              fusion_auto=Cited(FusionAuto.NEVER, src(SERVER_ARGS, "v0.5.14",
                                "LlamaForCausalLM is on no fusion auto-enable list"))),
    starts=OLDEST, changes=(GRAPHS_FIXED,),
    notes=("0.5.23 moved Llama's capture into the decoder layer; what that does to id 0 is not profiled",),
)

QWEN = Line(
    "sglang", "qwen2", ("qwen2", "qwen3"),
    Behaviour(**_setter("models/qwen2.py", "v0.5.12"), **_loop("models/qwen2.py", "v0.5.12", guarded=True),
              config=CONFIG, pp=PP_EARLY_RETURN, graphs=GRAPHS_BEFORE,
              fusion_auto=Cited(FusionAuto.NEVER, src(SERVER_ARGS, "v0.5.14",
                                "Qwen2/Qwen3 (dense) are on no fusion auto-enable list"))),
    starts=OLDEST, changes=(GRAPHS_FIXED,),
    notes=("Qwen3Model subclasses Qwen2Model: the same capture",),
)

# the fusion auto-enable history of a model that joined the list in 0.5.7, and #22836 between
FUSION_HISTORY = (
    Change(("1ab9b8e0a",), "fusion auto-enabled on SM90/SM100", None, "0.5.7", {"fusion_auto": FUSION_057}),
    GRAPHS_FIXED,
    Change((), "H20 no longer excluded from fusion", None, "0.5.13", {"fusion_auto": FUSION_0513}),
    Change(("#28789",), "fusion backend auto; SM100 across nodes", date(2026, 6, 20), "0.5.14",
           {"fusion_auto": FUSION_0514}),
)

_COMM = src("layers/communicator.py", "v0.5.6",
            "prepare_attn_and_capture_last_layer_outputs: the residual after prepare_attn (fused all-reduce + add "
            "+ norm), residual.clone() when no gather ran (\"Clone to avoid modifying the original residual by "
            "Custom RMSNorm inplace operation\"); added by PR #12002")
_QSET = src("models/qwen2_moe.py", "v0.5.12",
            "set_eagle3_layers_to_capture does setattr(self.layers[layer_id], '_is_layer_to_capture', True): "
            "an id past the last layer raises IndexError at start-up (inferred from the code)")
QWEN3_MOE = Line(
    "sglang", "qwen3_moe", ("qwen3_moe",),
    Behaviour(**_setter("models/qwen3_moe.py", "v0.5.12"), embed=Cited(EmbedId.CAPTURED, _COMM),
              out_of_range=Cited(OutOfRange.REFUSED, _QSET), order=Cited(Order.ASCENDING, _COMM),
              duplicates=Cited(Duplicates.CAPTURED_ONCE, _QSET), site=Cited(Site.AFTER_FUSED_ADD, _COMM),
              cloned=Cited(True, _COMM), last_boundary=Cited(False, _QSET), config=CONFIG, pp=PP_EARLY_RETURN, graphs=GRAPHS_BEFORE,
              fusion_auto=Cited(FusionAuto.NEVER, src(SERVER_ARGS, "v0.5.6", "Qwen3Moe joins the list in 0.5.7"))),
    starts=OLDEST, changes=FUSION_HISTORY,
)

GO = "models/gpt_oss.py"
GPT_OSS = Line(
    "sglang", "gpt_oss", ("gpt_oss",),
    Behaviour(**_setter(GO, "v0.5.16"), **_loop(GO, "v0.5.16", guarded=False), config=CONFIG, pp=PP_EARLY_RETURN, graphs=GRAPHS_BEFORE,
              fusion_auto=Cited(FusionAuto.SM100, src(SERVER_ARGS, "v0.5.6", "GptOss: is_blackwell_supported()"))),
    starts=OLDEST,
    changes=(
        *FUSION_HISTORY,
        Change(("#32334",), "boundary ids with the final boundary (fixes #32226)", None, "0.5.17",
               {"numbering": Cited(Numbering.PLUS_ONE_UNLESS_MAX_IS_L, g := src(GO, "v0.5.17",
                              "`if layer_ids and max(layer_ids) == num_layers: list(layer_ids)` else [val + 1]; "
                              "captures boundary start_layer before the loop (residual None -> hidden_states) and "
                              "boundary i + 1 after each layer i")),
                "embed": Cited(EmbedId.CAPTURED, g), "last_boundary": Cited(True, g)}),
    ),
    notes=("before #32334, nvidia/gpt-oss-120b-Eagle3-v3's ids [24, 30, 36] became [25, 31, 37]: 37 never "
           "matched, two states instead of three, and the draft crashed (issue #32226)",),
)

LINES = (DEEPSEEK, LLAMA, QWEN, QWEN3_MOE, GPT_OSS)
