"""What SGLang's `return_hidden_states` gives back per request under speculative decoding, per version (the
route data-generation pipelines take to the target's hidden states), and which token positions those rows are.

A verify round that starts at position p (token p sampled, its state not yet computed) runs positions p..p+k and
accepts `a` draft tokens: tokens p+1..p+a+1 are emitted and rows p..p+a are the states of this request's tokens.
Up to 0.5.13 the decode step appends `logits_output.hidden_states[i]` (request i's index into the verify batch's
rows): one row per round, whatever was accepted (at batch size 1 the round's first position; with more requests
row i of a `[bs * draft tokens, H]` buffer belongs to request i // draft tokens, not i: not replayed here). PR
#28496 (first in 0.5.14) appends rows `start .. start + accept_len` of each request. The prefill appends the
prompt's rows in both (`_append_prefill_hidden_states`). Under EAGLE-3 `logits_output.hidden_states` holds the
aux states concatenated (sglang issue #10059)."""

from __future__ import annotations

from enum import Enum

from tpsim.profiles import sglang_server
from tpsim.profiles.history import History
from tpsim.profiles.cited import Change, Cited

PROCESSOR = "managers/scheduler_components/batch_result_processor.py"
DECODE = "BatchResultProcessor.process_batch_result_decode"


class Returned(Enum):
    """Which positions' hidden states a served request returns to the client."""

    ONE_PER_ROUND = "one row per verify round (the request's index into the verify batch), whatever it accepted"
    ACCEPTED = "each round's accepted rows: one per token it emits"

    def positions(self, prompt: int, accepted: tuple[int, ...]) -> list[int]:
        """The token positions whose states come back, in order: the prompt's, then each round's."""
        out, p = list(range(prompt)), prompt
        for a in accepted:
            out += [p] if self is Returned.ONE_PER_ROUND else list(range(p, p + a + 1))
            p += a + 1
        return out


ONE_ROW = Cited(Returned.ONE_PER_ROUND, sglang_server.src(
    PROCESSOR, "v0.5.13", DECODE,
    "if req.return_hidden_states and logits_output.hidden_states is not None: req.hidden_states.append( "
    "logits_output.hidden_states[i].cpu().clone().tolist() )",
    "the same append on the spec-V1 path and the spec-V2 path (sglang issue #26163: 'return_hidden_states=True "
    "silently returns fewer per-token hidden states than completion_tokens under all speculative decoding paths'); "
    "older releases not read"))
ACCEPTED_ROWS = Change(("#28496",), "Fix return_hidden_states under spec V2", None, "0.5.14", {
    "returned": Cited(Returned.ACCEPTED, sglang_server.src(
        PROCESSOR, "v0.5.14", DECODE,
        "stride = result.speculative_num_draft_tokens accept_len = len(next_token_id) start = i * stride "
        "req.hidden_states.extend( logits_output.hidden_states[start : start + accept_len]",
        "PR #28496 ('[Spec] Fix return_hidden_states under spec V2 (issue #26163)'): first in 0.5.14, absent from "
        "0.5.13; 0.5.14's processor has no spec-V1 branch; later releases not re-read"))})
RETURNED = History("sglang", "return_hidden_states under speculative decoding", "returned", ONE_ROW,
                   (ACCEPTED_ROWS,), "0.5.13", sglang_server.RELEASES)
