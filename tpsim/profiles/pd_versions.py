"""`--server ENGINE@VERSION` -> the PD-disaggregation hand-off that version does (tpsim.profiles.pd), from
the engine's whole history of it, which reaches before the model files' profiled range."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from tpsim.profiles import sglang_server
from tpsim.profiles.history import Held, History
from tpsim.profiles.pd import PdTransfer, Widths
from tpsim.profiles.cited import Change, Cited, Versions

OLDEST_READ = "0.5.1"  # the oldest wheel whose hand-off was read
FIXED_IN = "0.5.6"  # the first release read that has both PRs (their first releases are unknown)

# Not the model file's code (the scheduler's and disaggregation/'s), and its history reaches before the oldest
# release read for the model files: PD holds all of it (wheels 0.5.1, 0.5.5 and 0.5.6 read). Neither PR's first
# release is known (release=None): 0.5.1 lacks #9976 and 0.5.5 has it; 0.5.5 lacks #13590 and 0.5.6 has it (post
# releases between not read).

PREFILL, SCHED = "disaggregation/prefill.py", "managers/scheduler.py"
PD_PREFILL = "SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill"
_SET_BUF = ("MetadataBuffers.set_buf copies it into `self.output_hidden_states[req.metadata_buffer_index]`, a row "
            "hidden_size wide, before the transfer: a tensor of another width fails that copy_ (inferred from the code)")
PD_TARGET_AUX = Cited(PdTransfer.TARGET_AUX, sglang_server.src(
    PREFILL, "v0.5.1", PD_PREFILL,
    "req.hidden_states_tensor = ( logits_output.hidden_states[last_hidden_index].cpu().clone() )",
    "the target's logits_output hidden states of the last token, under EAGLE-3 the aux states concatenated (issue "
    "#10059: 'the hidden states in logits_output include shallow, middle, and last hidden states(Aux hidden "
    "states)', 'I see the shape is 3X'); the buffer is hf_text_config.hidden_size (the target's) wide; " + _SET_BUF
    + ". PR #10547 (closed, unmerged) would have kept the first, shallow state only"),
    "shape error (issue #10059: 'It will cause shape error when use eagle3 with pd disaggregation'; the copy into "
    "the buffer fails: inferred from the code)")
PD_9976 = Change(("#9976",), "PD disaggregation sends the draft's hidden state (spec_info), not logits_output's",
                 date(2025, 9, 3), None, {"pd": Cited(PdTransfer.DRAFT_IN_TARGET_WIDTH, sglang_server.src(
                     PREFILL, "v0.5.5", PD_PREFILL,
                     "req.hidden_states_tensor = ( batch.spec_info.hidden_states[i].cpu().clone() )",
                     "the draft's hidden state after its extend (PR #9976); the buffer is still the target's width: "
                     "Scheduler.init_disaggregation passes hidden_size=self.model_config.hf_text_config.hidden_size; "
                     + _SET_BUF),
                     "shape mismatch in send_kv_chunk when the draft's hidden size differs from the target's (PR "
                     "#13590: Llama-3.3-70B with yuhuili/EAGLE3-LLaMA3.3-Instruct-70B crashed there; the error text "
                     "is not quoted: inferred from the code)")})
PD_13590 = Change(("#13590",), "PD disaggregation buffers sized with the draft's hidden size", date(2025, 11, 19),
                  None, {"pd": Cited(PdTransfer.DRAFT, sglang_server.src(
                      SCHED, "v0.5.6", "Scheduler.init_disaggregation",
                      "hidden_size=( model_config.hidden_size if self.spec_algorithm.is_eagle() else 16 # minimal "
                      "padding size for RDMA ),",
                      "model_config is the draft runner's (PR #13590: 'the buffers to move the draft model's hidden "
                      "states are allocated based on the target model's hidden state size. This works only if target "
                      "and draft model have the same hidden state size'); prefill.py still sends "
                      "batch.spec_info.hidden_states[i]; read at 0.5.6, later releases not re-read here"))})
PD = History("sglang", "the PD-disaggregation hand-off", "pd", PD_TARGET_AUX, (PD_9976, PD_13590), OLDEST_READ,
             sglang_server.RELEASES)


@dataclass(frozen=True)
class PdVersion:
    """The hand-off of one engine version (`held`: its cited behaviour and the versions it holds for)."""

    held: Held[PdTransfer]

    @property
    def transfer(self) -> PdTransfer:
        return self.held.value

    @property
    def cited(self) -> Cited[PdTransfer]:
        return self.held.cited

    @property
    def versions(self) -> Versions:
        return self.held.versions

    def fix(self) -> str:
        prs = ", ".join(c.label for c in PD.changes)
        return (f"serve with sglang {FIXED_IN} or later ({prs}; first release unknown: {FIXED_IN} is the first "
                "release tpsim read that has both)")

    def failure(self, w: Widths) -> str | None:
        """The engine's failure at these widths, in its words (None: the hand-off runs)."""
        return None if self.transfer.fits(w) else self.cited.error


def pd_version(server: str) -> PdVersion:
    """The hand-off `server` (`sglang[@VERSION][:MODEL]`) does (UsageError for an engine without one)."""
    return PdVersion(PD.at(server))
