"""The training side: SpecForge (its removed HF-hook backend and its SGLang backend), the original
EAGLE repository (hard-coded layers) and transformers' `output_hidden_states` (index by index).
SpecForge and EAGLE publish no release tags: their versions are dates or `latest`.
"""

from __future__ import annotations

from datetime import date

from tpsim.profiles.profile import (HARD_CODED, NESTED, NO_CONFIG, Behaviour, Change, Cited, ConfigKey, ConfigRead, Defaults,
                                    Duplicates, EmbedId, Empty, Line, Numbering, Order, OutOfRange, Site, Source)

SPECFORGE = "sgl-project/SpecForge"
_RESOLVE = Source(SPECFORGE, "specforge/algorithms/model_providers.py", "a6b6b023",
                  "resolve_eagle_capture_layers: the run's aux_hidden_state_layer_ids, else eagle_config."
                  "eagle_aux_hidden_state_layer_ids, else [1, L // 2 - 1, L - 4]; exactly three non-negative ids")
_CONFIG = Cited(ConfigRead((ConfigKey(NESTED),), Empty.REFUSED, overridden_by="the training run's "
                           "aux_hidden_state_layer_ids"), _RESOLVE)
_HOOK = Source(SPECFORGE, "specforge/inference/target_engine/target_capture_policy.py", "7d1fbf08^",
               "hf_capture: a forward hook on layers[idx] keeps the layer's output; ids outside 0 <= idx < "
               "len(layers) raise ValueError; `len(captured_states) != 3` raises (a repeated id); torch.cat in list order")
_DISTINCT = Source(SPECFORGE, "specforge/application/planning.py", "a6b6b023",
                   "aux_hidden_state_layer_ids must contain exactly three distinct non-negative layer ids")
_SERVER = Source(SPECFORGE, "specforge/offline_capture/sglang_backend/capture.py", "a6b6b023",
                 "model_runner.model.set_eagle3_layers_to_capture(layer_ids) with the ids unchanged: SGLang's own "
                 "numbering applies (SpecForge pins sglang 0.5.14)")
_WIDTH = Source(SPECFORGE, "specforge/inference/capture.py", "a6b6b023",
                "the server's recorded aux layer ids must equal the requested ids and the width 3 x hidden, else it "
                "raises")
_SGLANG_DS = Source("sgl-project/sglang", "python/sglang/srt/models/deepseek_v2.py", "v0.5.14",
                    "+1 only when the first id is 1 (PR #25454); internal id 0 captures the embedding output "
                    "(prepare_attn: residual None -> hidden_states)")
_SGLANG_LOOP = Source("sgl-project/sglang", "python/sglang/srt/models/llama.py", "v0.5.14",
                      "[val + 1 for val in layer_ids], captured before layer i in loop order")

_HF_BACKEND = Behaviour(
    numbering=Cited(Numbering.OUTPUT_OF, _HOOK), defaults=Cited(Defaults.OUTPUT_OF_1_MIDM1_LAST4, _RESOLVE),
    embed=Cited(EmbedId.UNREACHABLE, _RESOLVE), out_of_range=Cited(OutOfRange.REFUSED, _HOOK),
    order=Cited(Order.LIST, _HOOK), duplicates=Cited(Duplicates.REFUSED, _HOOK), config=_CONFIG,
    site=Cited(Site.BETWEEN_LAYERS, _HOOK), cloned=Cited(False, _HOOK), last_boundary=Cited(True, _HOOK))


def _server_backend(numbering: Cited, embed: Cited) -> Change:
    return Change(("7d1fbf08",), "HF-hook backend removed: capture through SGLang", date(2026, 7, 14), None,
                  {"numbering": numbering, "embed": embed, "order": Cited(Order.ASCENDING, _SGLANG_LOOP),
                   "duplicates": Cited(Duplicates.REFUSED, _DISTINCT), "out_of_range": Cited(OutOfRange.REFUSED, _WIDTH),
                   "last_boundary": Cited(False, _SGLANG_LOOP)})


SPECFORGE_ANY = Line(
    "specforge", "any", (), _HF_BACKEND,
    changes=(_server_backend(Cited(Numbering.OUTPUT_OF_PLUS_ONE, _SGLANG_LOOP), Cited(EmbedId.UNREACHABLE, _RESOLVE)),),
    notes=("SpecForge has no release tags: give a date (specforge@2026-07-01) or nothing for the current code",),
)

SPECFORGE_DEEPSEEK = Line(
    "specforge", "deepseek_v2", ("deepseek_v2", "deepseek_v3", "kimi_k2"), _HF_BACKEND,
    changes=(_server_backend(Cited(Numbering.PLUS_ONE_IF_FIRST_IS_1, _SGLANG_DS), Cited(EmbedId.CAPTURED, _SGLANG_DS)),),
    notes=("through SGLang 0.5.14's deepseek_v2.py a first id other than 1 gets no +1: ids then mean 'before "
           "layer j', one layer earlier than the same ids on a Llama target",),
)

def _fixed(source: Source, **values) -> Behaviour:
    """A behaviour read from one place: every field cites `source`."""
    return Behaviour(**{k: Cited(v, source) for k, v in values.items()})


_EAGLE = Source("SafeAILab/EAGLE", "eagle/traineagle3/modeling_llama_kv.py", "cb7e0841",
                "`if idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2: all_hidden_states += "
                "(hidden_states,)` before layer idx; concatenated in that (layer) order (commit f2f23664, 'EAGLE3')")
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
             "output (index L); v5.24.0's capture_outputs keeps the same indexing")
TRANSFORMERS = Line(
    "transformers", "any", (),
    _fixed(_HF, numbering=Numbering.HIDDEN_STATES_INDEX, defaults=Defaults.NONE, embed=EmbedId.CAPTURED,
           out_of_range=OutOfRange.REFUSED, order=Order.LIST, duplicates=Duplicates.CAPTURED_TWICE, config=NO_CONFIG,
           site=Site.BETWEEN_LAYERS, cloned=False, last_boundary=True),
    notes=("a negative index counts from the end in Python (-1 is the final-norm output); tpsim refuses it",),
)

LINES = (SPECFORGE_DEEPSEEK, SPECFORGE_ANY, EAGLE, TRANSFORMERS)
