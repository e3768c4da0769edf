"""vLLM's dual-batch overlap (`--enable-dbo`) under EAGLE-3, per version: how the runner merges the two
micro-batches' model outputs. With aux hidden states the target returns `(hidden_states, aux_hidden_states)` per
micro-batch, `aux_hidden_states` a *list* of tensors (model_executor/models/llama.py: `return hidden_states,
aux_hidden_states`, the list `_maybe_add_hidden_state` builds); up to 0.21.0 the ubatch wrapper concatenated the
outputs as tensors, which fails on the tuples at start-up (profile run): vllm-project/vllm issue #40769. PR #40789
(first in 0.22.0) concatenates each tuple component, and so calls torch.cat on the micro-batches' aux *lists*, which
fails too ("TypeError: expected Tensor as element 0 in argument 0, but got list"), the same code to 0.33.0. 0.34.0's
`merge_ubatch_outputs` (vllm/v1/worker/gpu/ubatch_utils.py; gpu_ubatch_wrapper.py is gone) recurses into tuples and
lists: the first release whose merge holds.
The same class in another engine: ROCm/ATOM PR #1418 ("TBO assumed that each ubatch model forward returned a
single torch.Tensor"). tpsim's micro-batch merge (`check --tbo --strategy micro-batches`) concatenates each
micro-batch's capture in token order and equals the whole-batch capture (tests/test_tbo.py)."""

from __future__ import annotations

from enum import Enum

from tpsim.profiles import vllm
from tpsim.profiles.history import History
from tpsim.profiles.cited import Change, Cited

WRAPPER = "vllm/v1/worker/gpu_ubatch_wrapper.py"


class UbatchMerge(Enum):
    """How the engine joins its micro-batches' outputs after a split forward."""

    TENSORS_ONLY = "the micro-batches' outputs concatenated as tensors: a tuple of (hidden, aux) fails"
    TUPLE_COMPONENTS = ("each tuple component concatenated as a tensor: the aux component, a list of tensors, "
                        "fails")
    RECURSIVE = "each component of the outputs merged in micro-batch order, into tuples and lists (aux states included)"

    @property
    def fails(self) -> bool:
        return self is not UbatchMerge.RECURSIVE


TENSORS = Cited(UbatchMerge.TENSORS_ONLY, vllm.src(
    WRAPPER, "0.18.0", "UBatchWrapper._run_ubatches",
    "sorted_results = [value for position, value in sorted(results)] result = torch.cat(sorted_results, dim=0)",
    "the same in 0.19.0, 0.20.0 and 0.21.0 (read); issue #40769: 'During profile_run, the ubatch wrapper crashes in "
    "torch.cat because the model's per-ubatch output is a tuple rather than a single Tensor'"),
    error="TypeError: expected Tensor as element 0 in argument 0, but got tuple (vllm PR #40789, at start-up: "
          "--enable-dbo with EAGLE-3)")
PER_COMPONENT = Change(("#40789",), "support tuple model outputs in ubatch wrapper (dbo + spec decode)", None, "0.22.0",
                       {"ubatch": Cited(UbatchMerge.TUPLE_COMPONENTS, vllm.src(
                           WRAPPER, "0.22.0", "_cat_ubatch_outputs",
                           "if sorted_results and isinstance(sorted_results[0], tuple): return tuple(torch.cat(parts, "
                           "dim=0) for parts in zip(*sorted_results))",
                           "first in 0.22.0, absent from 0.21.0; the same test in the 0.23.0 .. 0.27.0, 0.30.0, 0.32.0 "
                           "and 0.33.0 sdists; the aux component is a list (llama.py `return hidden_states, "
                           "aux_hidden_states`), so torch.cat gets lists"),
                           error="TypeError: expected Tensor as element 0 in argument 0, but got list (torch.cat of "
                                 "the micro-batches' aux lists, at start-up: --enable-dbo with EAGLE-3)")})
RECURSIVE = Change((), "runner v2 merges micro-batch outputs recursively", None, "0.34.0",
                   {"ubatch": Cited(UbatchMerge.RECURSIVE, vllm.src(
                       "vllm/v1/worker/gpu/ubatch_utils.py", "0.34.0", "merge_ubatch_outputs",
                       "if isinstance(first, tuple): return tuple(merge_ubatch_outputs(list(parts)) for parts in "
                       "zip(*outputs)) if isinstance(first, list): return [merge_ubatch_outputs(list(parts)) for "
                       "parts in zip(*outputs)]",
                       "first in 0.34.0 (gpu_ubatch_wrapper.py is gone): tuples and lists merged component by "
                       "component, the aux states included"))})
UBATCH = History("vllm", "dual-batch overlap's merge of the micro-batches' outputs", "ubatch", TENSORS,
                 (PER_COMPONENT, RECURSIVE), "0.18.0", vllm.RELEASES)
