"""The training side: SpecForge (its releases 0.1.0 and 0.2.0 on PyPI, its removed HF-hook backend
and its SGLang backend), the original EAGLE repository (hard-coded layers) and transformers'
`output_hidden_states` (index by index). SpecForge versions are its releases or dates; EAGLE has no
release tags.
"""

from __future__ import annotations

from datetime import date

from tpsim.profiles.cited import Change, Cited, Source, releases
from tpsim.profiles.profile import (HARD_CODED, NESTED, NO_CONFIG, Behaviour, ConfigKey, ConfigRead, Defaults,
                                    Duplicates, EmbedId, Empty, Line, Numbering, Order, OutOfRange, Site)

SPECFORGE = "sgl-project/SpecForge"
# the PyPI releases (no git tags): their archives' file dates; 0.2.0 pins sglang==0.5.14, and every file cited below
# is byte-identical to commit a6b6b023 (8 uncited files match abd0346d, 2026-08-07, instead)
RELEASES = releases("0.1.0 2025-08-01, 0.2.0 2026-08-10")
V020 = "v0.2.0"


def sf(path: str, ref: str, symbol: str, quote: str, note: str) -> Source:
    return Source(SPECFORGE, path, ref, note, symbol, quote)


_RESOLVE = sf("specforge/algorithms/model_providers.py", V020, "resolve_eagle_capture_layers",
              "layers = [1, num_layers // 2 - 1, num_layers - 4]",
              "the run's aux_hidden_state_layer_ids, else eagle_config.eagle_aux_hidden_state_layer_ids, else "
              "[1, L // 2 - 1, L - 4]; exactly three non-negative ids (the same at a6b6b023)")
_CONFIG = Cited(ConfigRead((ConfigKey(NESTED),), Empty.REFUSED, overridden_by="the training run's "
                           "aux_hidden_state_layer_ids"), sf(
    "specforge/algorithms/model_providers.py", V020, "resolve_eagle_capture_layers",
    "if len(layers) != 3 or any(not isinstance(i, int) or i < 0 for i in layers):",
    "the run option wins, then the nested key; an empty list is not three ids: refused"))
_HOOK = sf("specforge/inference/target_engine/target_capture_policy.py", "7d1fbf08^", "Eagle3CapturePolicy.hf_capture",
           "for idx in target_indices: if 0 <= idx < len(layers): handles.append(layers[idx].register_forward_hook("
           "get_hook(idx))) else: raise ValueError( f\"Layer index {idx} out of bounds for model with {len(layers)} "
           "layers.\"",
           "a forward hook on layers[idx] keeps the layer's output; ids outside 0 <= idx < len(layers) raise "
           "ValueError; torch.cat in list order")
_HOOK_COUNT = sf("specforge/inference/target_engine/target_capture_policy.py", "7d1fbf08^",
                 "Eagle3CapturePolicy.hf_capture",
                 "if len(captured_states) != 3: raise RuntimeError( f\"Expected to capture 3 layers, but captured "
                 "{len(captured_states)}\"", "a repeated id hooks one layer once: two states, refused")
_DISTINCT = sf("specforge/application/planning.py", V020, "_validate_algorithm_capabilities",
               "len(layers) != 3 or any(isinstance(layer, bool) or layer < 0 for layer in layers) or "
               "len(set(layers)) != len(layers)",
               "aux_hidden_state_layer_ids must contain exactly three distinct non-negative layer ids")
_SERVER = sf("specforge/offline_capture/sglang_backend/capture.py", V020,
             "OfflineSGLangCaptureBackend.set_eagle3_capture_layers",
             "self.model_runner.model.set_eagle3_layers_to_capture(layer_ids)",
             "the ids unchanged: SGLang's own numbering applies (SpecForge 0.2.0 pins sglang 0.5.14)")
_WIDTH = sf("specforge/inference/capture.py", V020, "_verify_capture_shapes",
            "if recorded_aux_layer_ids is not None: if tuple(recorded_aux_layer_ids) != "
            "capture.aux_hidden_state_layer_ids: raise CaptureMismatchError(",
            "the server's recorded aux layer ids must equal the requested ids (and the width 3 x hidden), else it "
            "raises")
_SGLANG_DS = Source("sgl-project/sglang", "python/sglang/srt/models/deepseek_v2.py", "v0.5.14",
                    "+1 only when the first id is 1 (PR #25454); internal id 0 captures the embedding output "
                    "(prepare_attn: residual None -> hidden_states)",
                    "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
                    "if layer_ids and layer_ids[0] == 1: self.model.layers_to_capture = [val + 1 for val in "
                    "layer_ids] else: self.model.layers_to_capture = list(layer_ids)")
_SGLANG_LOOP = Source("sgl-project/sglang", "python/sglang/srt/models/llama.py", "v0.5.14",
                      "[val + 1 for val in layer_ids], captured before layer i in loop order",
                      "LlamaForCausalLM.set_eagle3_layers_to_capture",
                      "self.capture_aux_hidden_states = True # we plus 1 here because in sglang, for the ith "
                      "layer, it takes the output # of the (i-1)th layer as aux hidden state "
                      "self.model.layers_to_capture = [val + 1 for val in layer_ids]")
# where SGLang 0.5.14 takes the capture: between layers in llama.py; inside the next decoder layer, after its fused
# all-reduce + add, for deepseek_v2.py (the HF hooks these fields cited before 7d1fbf08 are gone from 0.2.0)
_SGLANG_LLAMA_SITE = Source("sgl-project/sglang", "python/sglang/srt/models/llama.py", "v0.5.14",
                            "hidden_states + residual before layer i: between layers, a new tensor (no clone)",
                            "LlamaModel.forward",
                            "if i in self.layers_to_capture: aux_hidden_states.append(hidden_states + residual)")
_SGLANG_DS_SITE = Source("sgl-project/sglang", "python/sglang/srt/layers/communicator.py", "v0.5.14",
                         "deepseek_v2.py passes captured_last_layer_outputs into the decoder layer: the residual after "
                         "prepare_attn (fused all-reduce + add), cloned unless read-only (as sglang@0.5.14:deepseek_v2)",
                         "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs",
                         "if ( gathered_last_layer_output is residual and not "
                         "self._post_attn_residual_is_read_only(residual) ): gathered_last_layer_output = "
                         "residual.clone() captured_last_layer_outputs.append(gathered_last_layer_output)")
_V010 = sf("specforge/core/eagle3.py", "v0.1.0", "OnlineEagle3Model._prepare_data",
           "low_aux_layer = 1 + offset mid_aux_layer = num_layers // 2 - 1 + offset last_aux_layer = num_layers - 4 "
           "+ offset",
           "output_hidden_states indices 2, L//2, L-3 (offset 1 for the embedding): out(1), out(L//2-1), out(L-4), "
           "concatenated in that order; no config is read")

_HF_BACKEND = Behaviour(
    numbering=Cited(Numbering.OUTPUT_OF, _HOOK), defaults=Cited(Defaults.OUTPUT_OF_1_MIDM1_LAST4, _RESOLVE),
    embed=Cited(EmbedId.UNREACHABLE, _RESOLVE), out_of_range=Cited(OutOfRange.REFUSED, _HOOK),
    order=Cited(Order.LIST, _HOOK), duplicates=Cited(Duplicates.REFUSED, _HOOK_COUNT), config=_CONFIG,
    site=Cited(Site.BETWEEN_LAYERS, _HOOK), cloned=Cited(False, _HOOK), last_boundary=Cited(True, _HOOK))


def _server_backend(numbering: Cited, embed: Cited, site: Cited, cloned: Cited) -> Change:
    return Change(("7d1fbf08",), "HF-hook backend removed: capture through SGLang", date(2026, 7, 14), None,
                  {"numbering": numbering, "embed": embed, "site": site, "cloned": cloned,
                   "order": Cited(Order.ASCENDING, _SGLANG_LOOP),
                   "duplicates": Cited(Duplicates.REFUSED, _DISTINCT), "out_of_range": Cited(OutOfRange.REFUSED, _WIDTH),
                   "last_boundary": Cited(False, _SGLANG_LOOP)})


def _fixed(source: Source, **values) -> Behaviour:
    """A behaviour read from one place: every field cites `source`."""
    return Behaviour(**{k: Cited(v, source) for k, v in values.items()})



_V010_BEHAVIOUR = _fixed(_V010, numbering=Numbering.OUTPUT_OF, defaults=Defaults.OUTPUT_OF_1_MIDM1_LAST4,
                         embed=EmbedId.UNREACHABLE, out_of_range=OutOfRange.REFUSED, order=Order.LIST,
                         duplicates=Duplicates.CAPTURED_TWICE, config=HARD_CODED, site=Site.BETWEEN_LAYERS,
                         cloned=False, last_boundary=False)
_V010_STARTS = Change((), "SpecForge 0.1.0: hard-coded layers through transformers' output_hidden_states", None,
                      "0.1.0", {})
# #198 (94d67101, 2025-09-01) first read the ids from the config; the code changed several times until the HF-hook
# backend read at 7d1fbf08^ (0fb041f2, 2026-07-10, added its policy). tpsim replays that backend for the whole interval.
_CONFIGURED = Change(("#198",), "ids read from eagle_config (UNVERIFIED until 0fb041f2, 2026-07-10: #198's own default "
                     "was [1, L // 2, L - 4]; replayed as the HF-hook backend read at 7d1fbf08^)", date(2025, 9, 1),
                     None, {f: getattr(_HF_BACKEND, f) for f in Behaviour.FIELDS if getattr(_HF_BACKEND, f) is not None})
_NOTES = ("SpecForge releases: 0.1.0 (2025-08-01, hard-coded layers) and 0.2.0 (2026-08-10, the SGLang backend); "
          "a date (specforge@2026-07-01) names the code as of that day",)

SPECFORGE_ANY = Line(
    "specforge", "any", (), _V010_BEHAVIOUR, starts=_V010_STARTS,
    changes=(_CONFIGURED, _server_backend(Cited(Numbering.OUTPUT_OF_PLUS_ONE, _SGLANG_LOOP),
                                          Cited(EmbedId.UNREACHABLE, _RESOLVE),
                                          Cited(Site.BETWEEN_LAYERS, _SGLANG_LLAMA_SITE), Cited(False, _SGLANG_LLAMA_SITE))),
    notes=_NOTES,
)

SPECFORGE_DEEPSEEK = Line(
    "specforge", "deepseek_v2", ("deepseek_v2", "deepseek_v3", "kimi_k2"), _V010_BEHAVIOUR, starts=_V010_STARTS,
    changes=(_CONFIGURED, _server_backend(Cited(Numbering.PLUS_ONE_IF_FIRST_IS_1, _SGLANG_DS),
                                          Cited(EmbedId.CAPTURED, _SGLANG_DS),
                                          Cited(Site.AFTER_FUSED_ADD, _SGLANG_DS_SITE), Cited(True, _SGLANG_DS_SITE))),
    notes=(*_NOTES, "through SGLang 0.5.14's deepseek_v2.py a first id other than 1 gets no +1: ids then mean "
           "'before layer j', one layer earlier than the same ids on a Llama target"),
)


_EAGLE = Source("SafeAILab/EAGLE", "eagle/traineagle3/modeling_llama_kv.py", "cb7e0841",
                "before layer idx; concatenated in that (layer) order (commit f2f23664, 'EAGLE3')", "LlamaModel.forward",
                "if idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2: all_hidden_states += "
                "(hidden_states,)")
EAGLE = Line(
    "eagle", "any", (),
    _fixed(_EAGLE, numbering=Numbering.BEFORE_LAYER, defaults=Defaults.BEFORE_2_MID_LAST3,
           embed=EmbedId.UNREACHABLE, out_of_range=OutOfRange.REFUSED, order=Order.ASCENDING,
           duplicates=Duplicates.CAPTURED_ONCE, config=HARD_CODED, site=Site.BETWEEN_LAYERS, cloned=False,
           last_boundary=False),
    notes=("the layers are hard-coded: ids in a config are not read", "the repository has no release tags"),
)

_HF = Source("huggingface/transformers", "src/transformers/models/llama/modeling_llama.py", "v4.51.3",
             "output_hidden_states: the input of every decoder layer (index 0: inputs_embeds), then the final norm's "
             "output (index L); v5.24.0's capture_outputs keeps the same indexing", "LlamaModel.forward",
             "for decoder_layer in self.layers[: self.config.num_hidden_layers]: if output_hidden_states: "
             "all_hidden_states += (hidden_states,)")
TRANSFORMERS = Line(
    "transformers", "any", (),
    _fixed(_HF, numbering=Numbering.HIDDEN_STATES_INDEX, defaults=Defaults.NONE, embed=EmbedId.CAPTURED,
           out_of_range=OutOfRange.REFUSED, order=Order.LIST, duplicates=Duplicates.CAPTURED_TWICE, config=NO_CONFIG,
           site=Site.BETWEEN_LAYERS, cloned=False, last_boundary=True),
    notes=("a negative index counts from the end in Python (-1 is the final-norm output); tpsim refuses it",),
)

LINES = (SPECFORGE_DEEPSEEK, SPECFORGE_ANY, EAGLE, TRANSFORMERS)
