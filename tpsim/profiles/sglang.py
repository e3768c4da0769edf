"""SGLang's profiles: DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2), Llama, Qwen2/Qwen3, Qwen3-MoE and GPT-OSS
model files, from 0.5.6 to 0.5.23, each behaviour read from the released code (the PyPI wheel of the
release named in the source: its path, the function or class read and a few lines of it). What the
server does around the model files, and the releases read, is in sglang_server.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import date

from tpsim.profiles.cited import Change, Cited, Source
from tpsim.profiles.profile import (Behaviour, Defaults, Duplicates, EmbedId, FusionAuto, Gather, Line, Numbering,
                                    Order, OutOfRange, Site, TboCapture)
from tpsim.profiles.sglang_server import (COMMON, COMMON_START, FUSION_057, FUSION_058, FUSION_0510, FUSION_0513,
                                          FUSION_0514, FUSION_0515, FUSION_0519, FUSION_NEVER_V2, FUSION_V3_056, OLDEST,
                                          POST_056, SERVER_ARGS, src)

DS = "models/deepseek_v2.py"
DS_MODEL, DS_SET = "DeepseekV2Model.forward", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"
PLUS_ONE_QUOTE = ("self.capture_aux_hidden_states = True # we plus 1 here because in sglang, for the ith layer, it "
                  "takes the output # of the (i-1)th layer as aux hidden state self.model.layers_to_capture = "
                  "[val + 1 for val in layer_ids]")

# --- the capture loop and the id setters --------------------------------------------------------------


def _loop(path: str, ref: str, symbol: str, quote: str, guarded: bool, reviewed: tuple[str, ...] = ()) -> dict:
    """The model-level capture loop shared by the model files before the in-layer capture:
    `hidden_states + residual` before layer i for i in start..end (the add makes a new tensor)."""
    loop = src(path, ref, symbol, quote,
               "before layer i, `if i in self.layers_to_capture: aux_hidden_states.append(hidden_states + residual)`"
               + (" (residual None at layer 0: the hidden states alone)" if guarded else
                  "; residual is None before layer 0") + "; the loop runs start_layer..end_layer", reviewed)
    return dict(
        embed=Cited(EmbedId.CAPTURED if guarded else EmbedId.CRASHES, loop),
        out_of_range=Cited(OutOfRange.DROPPED, loop), order=Cited(Order.ASCENDING, loop),
        duplicates=Cited(Duplicates.CAPTURED_ONCE, loop), site=Cited(Site.BETWEEN_LAYERS, loop),
        cloned=Cited(False, loop), last_boundary=Cited(False, loop))


def _setter(path: str, ref: str, symbol: str, quote: str = PLUS_ONE_QUOTE) -> dict:
    s = src(path, ref, symbol, quote, "set_eagle3_layers_to_capture: None -> [2, n//2, n-3]; ids -> [val + 1 for val "
                                      "in layer_ids] (\"for the ith layer, it takes the output of the (i-1)th layer\")")
    return dict(numbering=Cited(Numbering.OUTPUT_OF_PLUS_ONE, s), defaults=Cited(Defaults.BEFORE_2_MID_LAST3, s))


def _in_layer(path: str, ref: str, symbol: str, quote: str, note: str, last: bool = False) -> dict:
    """The in-layer capture through the layer boundary (0.5.21+): the residual after the layer's fused
    all-reduce + add, copied when borrowed; at layer 0 the embedding output itself; the loop still tests
    `i in self.layers_to_capture` (`last`: the final boundary is captured too)."""
    c = src(path, ref, symbol, quote, note + "; StageBoundary._prepare_attention (layers/layer_boundary/stage.py) "
            "captures the embedding before layer 0 (`stream.residual is None`) and else the residual after the fused "
            "all-reduce + add; AuxHiddenStateList.capture clones a borrowed tensor")
    return {**_fused_add(c), "order": Cited(Order.ASCENDING, c), "out_of_range": Cited(OutOfRange.DROPPED, c),
            "duplicates": Cited(Duplicates.CAPTURED_ONCE, c), "last_boundary": Cited(last, c)}


def _fused_add(c: Source) -> dict:
    """A capture in the decoder layer, as `c` shows it: the residual after the layer's fused all-reduce + add,
    cloned (a new tensor either way), and at layer 0 the embedding output."""
    return {"site": Cited(Site.AFTER_FUSED_ADD, c), "cloned": Cited(True, c), "embed": Cited(EmbedId.CAPTURED, c)}


def _dense_in_layer(path: str, symbol: str, note: str) -> Change:
    """0.5.22: a dense model file's forward passes the capture to decoder layer i (the layer boundary)."""
    return Change((), "capture inside the decoder layer (layer boundary)", None, "0.5.22", _in_layer(
        path, "v0.5.22", symbol, "hidden_states = self.layers[i]( positions, hidden_states, forward_batch, "
        "capture_output=aux_hidden_states.capture if i in self.layers_to_capture else None, )", note))


def _with(changes: tuple[Change, ...], extra: tuple[Change, ...]) -> tuple[Change, ...]:
    """`changes` and `extra` in release order, those of one release merged into one change."""
    merged: dict[str, Change] = {}
    for c in (*changes, *extra):
        if c.release in merged:
            m = merged[c.release]
            c = replace(m, prs=tuple(dict.fromkeys((*m.prs, *c.prs))), title=f"{m.title}; {c.title}",
                        merged=m.merged or c.merged, changes={**m.changes, **c.changes})
        merged[c.release] = c
    kept = [c for c in merged.values() if c.changes]  # a change another architecture's rule made: none here
    return tuple(sorted(kept, key=lambda c: tuple(int(x) for x in c.release.split("."))))


# --- DeepSeek: one model file, two architectures (fusion is auto-enabled for DeepseekV3ForCausalLM only) ---

_DS_LOOP = "if i in self.layers_to_capture: aux_hidden_states.append(hidden_states + residual)"
TBO = Cited(TboCapture.REGION_NOT_CAPTURED, src(
    DS, "v0.5.6", DS_MODEL,
    "if forward_batch.can_run_tbo: if ( self.first_k_dense_replace > normal_start_layer and "
    "self.first_k_dense_replace < normal_end_layer ): normal_end_layer = self.first_k_dense_replace elif "
    "self.first_k_dense_replace < normal_start_layer: normal_end_layer = normal_start_layer = 0",
    "the capture loop is `for i in range(normal_start_layer, normal_end_layer)`; the layers from "
    "first_k_dense_replace on run in model_forward_maybe_tbo after it, so no boundary >= first_k_dense_replace is "
    "captured (PR #32680, closed unmerged, reports '0 of 3 layers captured' on DeepSeek-V2-Lite). The same in every "
    "release 0.5.6 .. 0.5.23. The `elif` (a PP stage that starts after first_k_dense_replace runs no capture loop) "
    "is not modelled: PP with EAGLE-3 is refused at start-up in every release",
    reviewed=(*POST_056, "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10rc0", "0.5.10", "0.5.10.post1", "0.5.11",
              "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16")))


def _boundary(path: str, ref: str, symbol: str) -> Source:
    """Where the MoE decoder layers' capture through the layer boundary (0.5.21) is shown: the residual after the
    fused add, gathered when scattered; the embedding before layer 0."""
    return src(path, ref, symbol, "hidden_states = self.attn_boundary.prepare( hidden_states, forward_batch, "
               "captured_last_layer_outputs=captured_last_layer_outputs,",
               "the decoder layer captures through attn_boundary.prepare(captured_last_layer_outputs=...): "
               "StageBoundary stores the residual after the fused all-reduce + add, moved by the entry's input_move "
               "(the gather of a scattered stream) and copied when borrowed; before layer 0 the residual is "
               "initialised from the embedding (layer_boundary/prepare.py, read.init_residual; read at 0.5.22)")


_PACKER = "layers/aux_hidden_states.py"
_PACK_NOTE = ("DeepseekV2Model.forward collects into AuxHiddenStatePacker(len(self.layers_to_capture)); an id the "
              "loop never reaches, a repeated id (the loop tests `i in self.layers_to_capture` once per layer) or a "
              "slot in the two-batch-overlap region leaves it short and finalize() fails the forward; with nothing "
              "captured the model returns hidden_states alone and the ForCausalLM's unpack fails instead")
PACK_0517 = src(_PACKER, "v0.5.17", "AuxHiddenStatePacker.finalize",
                "assert ( self._buffer is not None and self._idx == self._num_captures ), f\"captured {self._idx} "
                "of {self._num_captures} aux hidden states\"", _PACK_NOTE)
PACK_0520 = src(_PACKER, "v0.5.20", "AuxHiddenStatePacker.finalize",
                "if self._buffer is None or self._idx != self._num_captures: raise RuntimeError( "
                "f\"captured {self._idx} of {self._num_captures} aux hidden states\" )",
                "the assert became a RuntimeError (the same at 0.5.23); " + _PACK_NOTE)
PACK_TEXT = "captured {i} of {n} aux hidden states"


def _packer(source: Source, error: str) -> dict:
    said = f"{error}: {PACK_TEXT}"
    return {"out_of_range": Cited(OutOfRange.FAILS, source, said), "duplicates": Cited(Duplicates.FAILS, source, said),
            "tbo": Cited(TboCapture.REGION_FAILS, source, said)}


_CP_LOCAL = Cited(Gather.LOCAL, src(
    DS, "v0.5.17", DS_MODEL,
    "if self.pp_group.is_last_rank and use_cp_v1: # allgather + rerrange hidden_states = "
    "cp_all_gather_rerange_output(",
    "the in-model prefill CP path (NSA/MLA) all-gathers only the final hidden states; the aux states keep the "
    "rank's token chunk. That path is in every release from 0.5.6 (is_nsa_enable_prefill_cp); which of its lines "
    "gather was read at 0.5.17 only (UNVERIFIED before 0.5.17); from 0.5.14 the eager runner's CP-v2 path "
    "(SGLANG_ENABLE_CP_V2) replaces it, and up to 0.5.17 it too gathers the hidden states alone. Re-read at every release 0.5.6 .. 0.5.16 and "
    "0.5.18, 0.5.19: the in-model path (enable_prefill_cp / nsa_use_prefill_cp / dsa|mla_use_prefill_cp, use_cp_v1 "
    "from 0.5.16) all-gathers hidden_states alone; the aux list is returned as captured",
    reviewed=("0.5.6", *POST_056, "0.5.7", "0.5.8", "0.5.8.post1", "0.5.9", "0.5.10rc0", "0.5.10", "0.5.10.post1", "0.5.11",
              "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
              "0.5.18", "0.5.19")))
_CP_V2_0518 = src(
    "model_executor/runner/eager_runner.py", "v0.5.18", "EagerRunner._execute_extend_cp_v2",
    "# DSpark aux tensors ride the same CP token split; gather them the same way. if aux_hidden_states is not None: "
    "if isinstance(aux_hidden_states, torch.Tensor): aux_hidden_states = cp_gather_after_forward( aux_hidden_states, "
    "forward_batch, stream )",
    "the CP-v2 path (is_cp_v2_active: layers/cp/utils.py enable_cp_v2 reads the environment variable "
    "SGLANG_ENABLE_CP_V2, not the model config) all-gathers the aux states from 0.5.18 (0.5.17's gathers the hidden "
    "states alone); the in-model CP-v1 path still does not. The server sets the variable to 1 when it is unset and "
    "the architecture is in CP_V2_DEFAULT_MODEL_CLASSES (DeepseekV3ForCausalLM, not DeepseekV2ForCausalLM; DSA "
    "models only under --cp-strategy interleave): ServerArgs._handle_context_parallelism at 0.5.18, "
    "arg_groups/parallel_hook.py handle_context_parallelism at 0.5.19", reviewed=("0.5.19",))
_CP_GATHERED = Cited(Gather.GATHERED, src(
    "model_executor/runner/eager_runner.py", "v0.5.20", "EagerRunner._execute_extend_cp",
    "if aux_hidden_states is not None: if isinstance(aux_hidden_states, torch.Tensor): aux_hidden_states = "
    "cp_gather_after_forward( aux_hidden_states, forward_batch, stream )",
    "DeepSeek's in-model CP path is gone; CP runs through the eager runner, which all-gathers the aux states like "
    "the hidden states (re-read at 0.5.23)"))


DS_GATHER_TP = src(DS, "v0.5.7", DS_MODEL, "if self.enable_a2a_moe and i > self.first_k_dense_replace: "
                   "aux_hidden_state = tensor_model_parallel_all_gather( hidden_states + residual, dim=0 )",
                   "under DeepEP, a boundary after first_k_dense_replace is all-gathered over the whole TP group "
                   "(tensor_model_parallel_all_gather) before capture (the same in 0.5.7 .. 0.5.9; 0.5.10rc0 already "
                   "gathers over the attention-TP group)", reviewed=("0.5.8", "0.5.8.post1", "0.5.9"))
DS_GATHER_ATTN = src(DS, "v0.5.10", DS_MODEL, "if self.enable_a2a_moe and i > self.first_k_dense_replace: "
                     "aux_hidden_state = get_attention_tp_group().all_gather( hidden_states + residual, dim=0 )",
                     "the gather is over the attention-TP group (the TP group unless DP attention splits it; the same "
                     "through 0.5.13.post1)", reviewed=("0.5.13", "0.5.13.post1"))
DS_LOOP_057 = "if i in self.layers_to_capture: if self.enable_a2a_moe and i > self.first_k_dense_replace:"
DS_SET_0513 = src(DS, "v0.5.13", DS_SET, "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3] else: "
                  "self.capture_aux_hidden_states = True # TODO (Qiaolin-Yu): check if other draft models need "
                  "similar layer id # adjustment if layer_ids and layer_ids[0] == 1:",
                  "`if layer_ids and layer_ids[0] == 1: [val + 1 ...] else: list(layer_ids)`; None -> [2, n//2, n-3] "
                  "(the same at 0.5.23)")
DS_LAYER = src(DS, "v0.5.14", "DeepseekV2DecoderLayer.forward",
               "hidden_states, residual = ( self.layer_communicator.prepare_attn_and_capture_last_layer_outputs( "
               "hidden_states, residual, forward_batch, captured_last_layer_outputs=captured_last_layer_outputs,",
               "the loop passes captured_last_layer_outputs into the decoder layer; LayerCommunicator."
               "prepare_attn_and_capture_last_layer_outputs appends the residual after prepare_attn (fused all-reduce "
               "+ add + norm), gathered by _communicate_simple_fn when scattered, cloned unless read-only; residual "
               "None -> hidden_states")
DS_LOOP_0514 = src(DS, "v0.5.14", DS_MODEL, "captured_last_layer_outputs=( aux_hidden_states if i in "
                   "self.layers_to_capture else None ),",
                   "the loop hands the collector to layer i when `i in self.layers_to_capture`: ascending, each layer "
                   "once, start_layer..end_layer (nothing after the last layer; the same in 0.5.16 .. 0.5.20)",
                   reviewed=("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20"))
DS_RENAMED = src(DS, "v0.5.22", "DeepseekV2DecoderLayer.forward",
                 "hidden_states = self.attn_boundary.prepare( hidden_states, forward_batch, "
                 "capture_gathered=captured_last_layer_outputs,",
                 "the layer boundary's argument renamed capture_gathered; the same capture (the same at 0.5.23)")
PACK_0522 = src(_PACKER, "v0.5.22", "AuxHiddenStatePacker.finalize",
                "if self._feature_size is None or self._idx != self._num_captures: raise RuntimeError( "
                "f\"captured {self._idx} of {self._num_captures} aux hidden states\" )",
                "the packer may write into a graph runner's buffer; the same count (the same at 0.5.23); " + _PACK_NOTE)


def _fusion(c: Cited, fusion: bool) -> dict:
    """DeepseekV3ForCausalLM's rule `c`; for DeepseekV2ForCausalLM the same code, which does not list it."""
    if fusion:
        return {"fusion_auto": c}
    return {"fusion_auto": Cited(FusionAuto.NEVER, replace(c.source, note="DeepseekV2ForCausalLM is not on this "
                                                           "rule's list (DeepseekV3ForCausalLM is): " + c.source.note))}


def _deepseek_changes(fusion: bool) -> tuple[Change, ...]:
    """DeepSeek's changes; `fusion`: the model is DeepseekV3ForCausalLM, which the fusion rule lists."""
    def f(c: Cited) -> dict:
        return _fusion(c, fusion)

    def layer(c: Source) -> dict:
        """The capture in the decoder layer as `c` shows it, gathered when the stream is scattered."""
        return {**_fused_add(c), "scattered": Cited(Gather.GATHERED, c)}
    loop = _loop(DS, "v0.5.7", DS_MODEL, DS_LOOP_057, guarded=False,
                 reviewed=("0.5.8", "0.5.8.post1", "0.5.9", "0.5.10rc0", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12",
                           "0.5.12.post1", "0.5.13", "0.5.13.post1"))
    walk = {k: Cited(loop[k].value, DS_LOOP_0514) for k in ("order", "out_of_range", "duplicates", "last_boundary")}
    boundary = _boundary(DS, "v0.5.21", "DeepseekV2DecoderLayer.forward")
    walk21 = src(DS, "v0.5.21", DS_MODEL, "captured_last_layer_outputs=aux_hidden_states if i in "
                 "self.layers_to_capture else None,", DS_LOOP_0514.note + " (the same at 0.5.23; 0.5.22 renames the final "
                 "norm's call final_norm)", reviewed=("0.5.22", "0.5.23"))
    return (
        Change(("#14280", "1ab9b8e0a"), "DeepEP capture all-gathered; the fusion rule's list", None, "0.5.7",
               {**loop, "scattered": Cited(Gather.GATHERED, DS_GATHER_TP), **f(FUSION_057)}),
        Change((), "fusion rule on SM100 for Blackwell", None, "0.5.8", f(FUSION_058)),
        Change((), "DeepEP capture gathered over the attention-TP group; fusion needs tp > 1", None, "0.5.10",
               {"scattered": Cited(Gather.GATHERED, DS_GATHER_ATTN), **f(FUSION_0510)}),
        Change(("#25454",), "+1 only when the first id is 1", date(2026, 5, 16), "0.5.13",
               {"numbering": Cited(Numbering.PLUS_ONE_IF_FIRST_IS_1, DS_SET_0513),
                "defaults": Cited(Defaults.BEFORE_2_MID_LAST3, DS_SET_0513), **f(FUSION_0513)}),
        Change(("#28343", "#28789"), "capture after the fused all-reduce + add, in the decoder layer", None, "0.5.14",
               {**layer(DS_LAYER), **walk, **f(FUSION_0514)}),
        Change((), "fusion rule moved to a post-process hook", None, "0.5.15", f(FUSION_0515)),
        Change((), "captures packed by AuxHiddenStatePacker: a missing slot fails the forward", None, "0.5.17",
               _packer(PACK_0517, "AssertionError")),
        Change((), "CP-v2 (SGLANG_ENABLE_CP_V2) all-gathers the aux states", None, "0.5.18",
               {"cp": Cited(Gather.GATHERED_UNLESS_CP_V2_OFF if fusion else Gather.GATHERED_IF_CP_V2, _CP_V2_0518)}),
        Change((), "fusion rule reads the platform through get_platform()", None, "0.5.19", f(FUSION_0519)),
        Change((), "the packer raises RuntimeError; CP gathers the aux states", None, "0.5.20",
               {**_packer(PACK_0520, "RuntimeError"), "cp": _CP_GATHERED}),
        Change((), "capture through the layer boundary", None, "0.5.21",
               {**layer(boundary), "order": Cited(walk["order"].value, walk21), "last_boundary": Cited(False, walk21)}),
        Change((), "the layer boundary's capture argument renamed; the packer's count re-read", None, "0.5.22",
               {**layer(DS_RENAMED), **_packer(PACK_0522, "RuntimeError")}),
    )


def _deepseek(family: str, models: tuple[str, ...], fusion: Cited) -> Line:
    base = Behaviour(
        **_setter(DS, "v0.5.6", DS_SET), **_loop(DS, "v0.5.6", DS_MODEL, _DS_LOOP, guarded=False, reviewed=POST_056),
        **COMMON_START, fusion_auto=fusion,
        scattered=Cited(Gather.LOCAL, src(DS, "v0.5.6", DS_MODEL, _DS_LOOP, "under DeepEP the stream between MoE "
                                          "layers is token-scattered and the capture adds the local shard",
                                          reviewed=POST_056)),
        tbo=TBO, cp=_CP_LOCAL)
    return Line("sglang", family, models, base, starts=OLDEST,
                changes=_with(_deepseek_changes(fusion.value is not FusionAuto.NEVER), COMMON),
                notes=("#28343's merge commit is not known; 0.5.14 is the first wheel with the decoder-layer "
                       "capture, which matches the PR's description (Kimi K2.5, AR fusion at tp > 1)",
                       "two-batch overlap (forward_batch.can_run_tbo) runs layers from first_k_dense_replace on "
                       "outside the capture loop: nothing there is captured (behaviour `tbo`; tpsim check --tbo "
                       "replays it); from 0.5.17 the packer then fails the forward",
                       "DeepseekV3ForCausalLM subclasses DeepseekV2ForCausalLM: the capture is the same; only "
                       "the fusion auto-enable rule names the architecture"))


DEEPSEEK_V2 = _deepseek("deepseek_v2", ("deepseek_v2",), FUSION_NEVER_V2)
DEEPSEEK_V3 = _deepseek("deepseek_v3", ("deepseek_v3", "kimi_k2"), FUSION_V3_056)
DEEPSEEK = DEEPSEEK_V3


def _never_fused(who: str) -> Cited:
    """A dense model file on no fusion auto-enable list, cited at the newest rule read."""
    return Cited(FusionAuto.NEVER, src(
        "arg_groups/overrides.py", "v0.5.23", "_flashinfer_allreduce_fusion_auto_enable",
        "and (is_mimo or model_arch in _FLASHINFER_ALLREDUCE_FUSION_ARCHS) and not prefer_custom_dsv41 "
        "and (get_platform().is_sm90 or get_platform().is_sm100) and view.tp_size > 1",
        f"{who} on no fusion auto-enable list (0.5.6 .. 0.5.23)"))


LL = "models/llama.py"
LLAMA = Line(
    "sglang", "llama", ("llama", "mistral"),
    Behaviour(**_setter(LL, "v0.5.12", "LlamaForCausalLM.set_eagle3_layers_to_capture"),
              **_loop(LL, "v0.5.12", "LlamaModel.forward", "aux_hidden_states = [] for i in range(self.start_layer, "
                      "self.end_layer): if i in self.layers_to_capture: aux_hidden_states.append(hidden_states + "
                      "residual)", guarded=False),
              **COMMON_START, fusion_auto=_never_fused("LlamaForCausalLM is")),
    starts=OLDEST,
    changes=_with(COMMON, (_dense_in_layer(LL, "LlamaModel.forward", "LlamaModel.forward passes capture_output to "
                                            "layer i; LlamaDecoderLayer.forward hands it to attn_boundary.prepare("
                                            "capture=...)"),)),
    notes=("checked at every release 0.5.6 .. 0.5.23: the setter keeps [val + 1] throughout; the id-0 crash "
           "ends in 0.5.22, whose in-layer capture takes the embedding before layer 0",),
)

Q2 = "models/qwen2.py"
QWEN = Line(
    "sglang", "qwen2", ("qwen2", "qwen3"),
    Behaviour(**_setter(Q2, "v0.5.12", "Qwen2ForCausalLM.set_eagle3_layers_to_capture",
                        "self.model.layers_to_capture = [ 2, num_layers // 2, num_layers - 3, ] # Specific layers for "
                        "EAGLE3 support else: self.model.layers_to_capture = [val + 1 for val in layer_ids]"),
              **_loop(Q2, "v0.5.12", "Qwen2Model.forward", "for i in range(self.start_layer, self.end_layer): if i in "
                      "self.layers_to_capture: aux_hidden_states.append( hidden_states + residual if residual is not "
                      "None else hidden_states", guarded=True),
              **COMMON_START, fusion_auto=_never_fused("Qwen2/Qwen3 (dense) are")),
    starts=OLDEST,
    changes=_with(COMMON, (
        Change((), "the capture copies through the residual stream's snapshot", None, "0.5.21", _loop(
            Q2, "v0.5.21", "Qwen2Model.forward", "for i in range(self.start_layer, self.end_layer): if i in "
            "self.layers_to_capture: aux_hidden_states.append(snapshot(hidden_states, residual))", guarded=True)),
        _dense_in_layer(Q2, "Qwen2Model.forward", "Qwen2Model.forward passes capture_output to layer i (Qwen3Model."
                        "forward in qwen3.py the same); 0.5.21 still captured between layers (`snapshot("
                        "hidden_states, residual)`)"))),
    notes=("Qwen3Model subclasses Qwen2Model: the same capture (from 0.5.22 qwen3.py has its own forward, "
           "the same capture_output)",),
)

_COMM = src("layers/communicator.py", "v0.5.6", "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
            "if gathered_last_layer_output is residual: # Clone to avoid modifying the original residual by Custom "
            "RMSNorm inplace operation gathered_last_layer_output = residual.clone()",
            "the residual after prepare_attn (fused all-reduce + add + norm), residual.clone() when no gather ran; "
            "added by PR #12002")
_QSET = src("models/qwen2_moe.py", "v0.5.12", "Qwen2MoeModel.set_eagle3_layers_to_capture",
            "for layer_id in self.layers_to_capture: setattr(self.layers[layer_id], \"_is_layer_to_capture\", True)",
            "an id past the last layer raises IndexError at start-up (inferred from the code; the same at 0.5.23)")
# the fusion auto-enable history of a model that joined the list in 0.5.7 (Qwen3-MoE, GPT-OSS)
FUSION_HISTORY = (
    Change(("1ab9b8e0a",), "fusion auto-enabled on SM90/SM100", None, "0.5.7", {"fusion_auto": FUSION_057}),
    Change((), "fusion rule on SM100 for Blackwell", None, "0.5.8", {"fusion_auto": FUSION_058}),
    Change((), "fusion needs tp > 1", None, "0.5.10", {"fusion_auto": FUSION_0510}),
    Change((), "H20 no longer excluded from fusion", None, "0.5.13", {"fusion_auto": FUSION_0513}),
    Change(("#28789",), "fusion backend auto; SM100 across nodes", date(2026, 6, 20), "0.5.14",
           {"fusion_auto": FUSION_0514}),
    Change((), "fusion rule moved to a post-process hook", None, "0.5.15", {"fusion_auto": FUSION_0515}),
    Change((), "fusion rule reads the platform through get_platform()", None, "0.5.19", {"fusion_auto": FUSION_0519}),
)
Q3 = "models/qwen3_moe.py"


def _qwen3_moe_layer(c: Source) -> dict:
    """Qwen3MoeDecoderLayer's capture as `c` shows it: in the decoder layer after the fused add, layers ascending."""
    return {**_fused_add(c), "order": Cited(Order.ASCENDING, c)}


QWEN3_MOE = Line(
    "sglang", "qwen3_moe", ("qwen3_moe",),
    Behaviour(**_setter(Q3, "v0.5.12", "Qwen3MoeForCausalLM.set_eagle3_layers_to_capture",
                        "self.model.set_eagle3_layers_to_capture([val + 1 for val in layer_ids])"),
              **_qwen3_moe_layer(_COMM), out_of_range=Cited(OutOfRange.REFUSED, _QSET),
              duplicates=Cited(Duplicates.CAPTURED_ONCE, _QSET), last_boundary=Cited(False, _QSET), **COMMON_START,
              fusion_auto=Cited(FusionAuto.NEVER, src(SERVER_ARGS, "v0.5.6", "ServerArgs._handle_model_specific_"
                                                      "adjustments", "elif model_arch in [\"GptOssForCausalLM\"]: if ( "
                                                      "self.attention_backend is None",
                                                      "Qwen3Moe is on no 0.5.6 fusion rule; it joins the list in "
                                                      "0.5.7", reviewed=POST_056))),
    starts=OLDEST,
    changes=_with(FUSION_HISTORY, (
        *COMMON,
        Change((), "the clone skipped where the fused norm writes a fresh residual", None, "0.5.14", _qwen3_moe_layer(
            src("layers/communicator.py", "v0.5.14", "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
                "if ( gathered_last_layer_output is residual and not self._post_attn_residual_is_read_only(residual) "
                "): gathered_last_layer_output = residual.clone()",
                "the residual after prepare_attn, cloned unless the fused norm wrote a fresh residual_out (a new "
                "tensor either way; the same in 0.5.14 .. 0.5.20)"))),
        Change((), "capture through the layer boundary", None, "0.5.21",
               _qwen3_moe_layer(_boundary(Q3, "v0.5.21", "Qwen3MoeDecoderLayer.forward"))),
        Change((), "the layer boundary's capture argument renamed", None, "0.5.22", _qwen3_moe_layer(src(
            Q3, "v0.5.22", "Qwen3MoeDecoderLayer.forward",
            "hidden_states = self.attn_boundary.prepare( hidden_states, forward_batch, "
            "capture_gathered=captured_last_layer_outputs, capture=capture_output,",
            "the layer boundary's argument renamed capture_gathered; the same capture (the same at 0.5.23)"))))),
    notes=("from 0.5.21 the decoder layer captures through the layer boundary (the residual after the fused add, "
           "as before; 0.5.22 renames the argument capture_gathered)",),
)

GO = "models/gpt_oss.py"
GPT_OSS = Line(
    "sglang", "gpt_oss", ("gpt_oss",),
    Behaviour(**_setter(GO, "v0.5.16", "GptOssForCausalLM.set_eagle3_layers_to_capture"),
              **_loop(GO, "v0.5.16", "GptOssModel.forward", "if i in self.layers_to_capture: "
                      "aux_hidden_states.append(hidden_states + residual)", guarded=False),
              **COMMON_START, fusion_auto=Cited(FusionAuto.SM100, src(
                  SERVER_ARGS, "v0.5.6", "ServerArgs._handle_model_specific_adjustments",
                  "if not self.enable_dp_attention and self.nnodes == 1: self.enable_flashinfer_allreduce_fusion = "
                  "True logger.info( \"Enable FlashInfer AllReduce Fusion on sm100 for GptOssForCausalLM\" )",
                  "GptOss: is_blackwell_supported(), no DP attention, one node", reviewed=POST_056))),
    starts=OLDEST,
    changes=_with(FUSION_HISTORY, (*COMMON,
        Change(("#32334",), "boundary ids with the final boundary (fixes #32226)", None, "0.5.17",
               {"numbering": Cited(Numbering.PLUS_ONE_UNLESS_MAX_IS_L, g := src(
                   GO, "v0.5.17", "GptOssForCausalLM.set_eagle3_layers_to_capture",
                   "self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3] else: "
                   "self.capture_aux_hidden_states = True # Preserve IDs that already include the final hidden-state "
                   "# boundary; otherwise retain the legacy output-layer conversion. if layer_ids and max(layer_ids) "
                   "== num_layers: self.model.layers_to_capture = list(layer_ids)",
                   "`if layer_ids and max(layer_ids) == num_layers: list(layer_ids)` else [val + 1]; GptOssModel."
                   "forward captures boundary start_layer before the loop (residual None -> hidden_states) and "
                   "boundary i + 1 after each layer i")),
                "defaults": Cited(Defaults.BEFORE_2_MID_LAST3, g), "embed": Cited(EmbedId.CAPTURED, g2 := src(
                    GO, "v0.5.17", "GptOssModel.forward", "if i + 1 in self.layers_to_capture: "
                    "aux_hidden_states.append( hidden_states + residual if residual is not None else hidden_states",
                    "boundary start_layer before the loop, boundary i + 1 after layer i: `hidden_states + residual` "
                    "between layers, ascending, each once")), "last_boundary": Cited(True, g),
                **{k: Cited(v, g2) for k, v in (("site", Site.BETWEEN_LAYERS), ("cloned", False),
                                                ("order", Order.ASCENDING), ("out_of_range", OutOfRange.DROPPED),
                                                ("duplicates", Duplicates.CAPTURED_ONCE))}}),
        Change((), "capture inside the decoder layer (layer boundary); the final boundary in the final norm", None,
               "0.5.21", _in_layer(
                   GO, "v0.5.21", "GptOssModel.forward",
                   "# Capture hidden-state boundaries: boundary 0 is the embedding output, # and boundary i + 1 is the "
                   "output after transformer block i.",
                   "boundary i before layer i through capture_output; boundary L in residual_batch.norm(..., "
                   "capture_output=...) (last_boundary stays reachable)", last=True)))),
    notes=("before #32334, nvidia/gpt-oss-120b-Eagle3-v3's ids [24, 30, 36] became [25, 31, 37]: 37 never "
           "matched, two states instead of three, and the draft crashed (issue #32226)",),
)

LINES = (DEEPSEEK_V2, DEEPSEEK_V3, LLAMA, QWEN, QWEN3_MOE, GPT_OSS)
