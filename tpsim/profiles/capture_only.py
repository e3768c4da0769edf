"""SGLang's capture-only mode, per version (issue 51 item 9): `--enable-return-aux-hidden-states` returns the aux
hidden states of a target served without a draft (`--speculative-algorithm EAGLE3` only names the capture
convention), from the layers `--return-aux-hidden-state-layer-ids` names, else the model's EAGLE-3 default.

The ids are checked at start-up in the user's numbering (not empty, none negative, none repeated, each below
num_hidden_layers), then handed to the model's `set_eagle3_layers_to_capture` exactly as a draft's ids are: the
model file's own numbering (SGLang's +1 included) decides the positions, so the ids SGLang's help says "may differ
from draft-checkpoint layer ids" are the ones to translate with `tpsim resolve`. First in 0.5.23; 0.5.22 has no
such flag (an unknown argument there)."""

from __future__ import annotations

from enum import Enum

from tpsim.profiles import sglang_server
from tpsim.profiles.cited import Change, Cited
from tpsim.profiles.history import History

CHECKS = "arg_groups/validation_hook.py"
RANGE = "model_executor/model_runner_components/spec_aux_hidden_state.py"


class CaptureOnly(Enum):
    ABSENT = "no capture-only mode: --enable-return-aux-hidden-states is an unknown argument"
    IDS_CHECKED = ("aux states returned without a draft; --return-aux-hidden-state-layer-ids checked at start-up "
                   "(not empty, >= 0, no repeats, < num_hidden_layers), then set as a draft's ids are")

    @property
    def served(self) -> bool:
        return self is CaptureOnly.IDS_CHECKED


NOT_IN_0522 = Cited(CaptureOnly.ABSENT, sglang_server.src(
    "arg_groups/fields/exec_.py", "v0.5.22", "ExecFeatures", "enable_return_hidden_states: A[",
    "0.5.22's execution features have enable_return_hidden_states and no enable_return_aux_hidden_states; no file "
    "of its srt/ names return_aux_hidden_state_layer_ids: the flag is an unknown argument there (nor does any wheel "
    "0.5.6 .. 0.5.21 name enable_return_aux_hidden_states)"))
CHECKED_0523 = Change((), "--enable-return-aux-hidden-states: aux capture on a target without a draft", None, "0.5.23", {
    "capture_only": Cited(CaptureOnly.IDS_CHECKED, sglang_server.src(
        CHECKS, "v0.5.23", "handle_aux_hidden_state_capture",
        "if any(layer_id < 0 for layer_id in layer_ids): raise ValueError( "
        "\"--return-aux-hidden-state-layer-ids must be non-negative, got \" f\"{list(layer_ids)}.\" )",
        "start-up: --speculative-algorithm must be EAGLE3, DFLASH or DSPARK (it only names the convention and is "
        "reset to None), no --speculative-draft-model-path, pp_size 1, the ids not empty, non-negative and not "
        "repeated; spec_aux_hidden_state.py _check_capture_layer_ids_in_range then refuses an id >= "
        "num_hidden_layers (times num_loops), and _resolve_capture_only_aux_hidden_state sets "
        "eagle_aux_hidden_state_layer_ids = the ids, which configure_aux_hidden_state_capture passes to "
        "model.set_eagle3_layers_to_capture as a draft's ids"))})
CAPTURE_ONLY = History("sglang", "the capture-only mode (--enable-return-aux-hidden-states)", "capture_only",
                       NOT_IN_0522, (CHECKED_0523,), "0.5.6", sglang_server.RELEASES)
RANGE_TEXT = "--return-aux-hidden-state-layer-ids {ids} out of range for a target with {L} layers."


def served(server: str, ids: list[int] | None, L: int) -> str | None:
    """Why `server` (an SGLang version) does not start in capture-only mode with these ids; None when it does."""
    held = CAPTURE_ONLY.at(server)
    if not held.value.served:
        later = held.later(lambda mode: mode.served)
        return f"{server} has {held.value.value} (first in sglang {later.release})"
    refused = startup_refusal(ids, L)
    return refused and f"{server} refuses to start: {refused}"


def startup_refusal(ids: list[int] | None, L: int) -> str | None:
    """SGLang 0.5.23's start-up checks on the ids as given (None: the flag not given, the model's default), in its
    words; None when the server starts."""
    if ids is None:
        return None
    if not ids:
        return "ValueError: --return-aux-hidden-state-layer-ids must not be empty."
    if any(i < 0 for i in ids):
        return f"ValueError: --return-aux-hidden-state-layer-ids must be non-negative, got {ids}."
    if len(set(ids)) != len(ids):
        return f"ValueError: --return-aux-hidden-state-layer-ids must not repeat a layer, got {ids}."
    out = [i for i in ids if i >= L]
    return f"ValueError: {RANGE_TEXT.format(ids=out, L=L)}" if out else None
