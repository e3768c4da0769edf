"""Communication modes: how the engine being replayed moves activations between ranks.

Every mode computes the same model; they differ in where the residual stream lives between
layers and which collectives move it (L layers, M of them MoE, D = L - M dense, tp > 1;
`expected_collectives` is the formula in code, and `check` compares it with the real trace):

| mode           | engine setting it replays                         | residual stream between layers     | collectives per forward |
|----------------|---------------------------------------------------|------------------------------------|-------------------------|
| `tp`           | SGLang/vLLM `--tp N`                               | Replicate()                        | all_reduce 1 + 2L; all_gather 1 (logits) |
| `ar-fusion`    | SGLang `--enable-flashinfer-allreduce-fusion`      | Partial(sum) hidden + Replicate() residual after layers 0..L-2 when T <= fusion_max_tokens | as `tp`, but layer k's MLP all-reduce runs in layer k+1's input_layernorm |
| `sp`           | Megatron sequence parallelism                      | Shard(dim=0) (tokens padded to a multiple of tp) | reduce_scatter 1 + 2L; all_gather 2L + 2; no all_reduce |
| `ep`           | SGLang `--moe-a2a-backend deepep` / `--ep N`       | Shard(dim=0) after the first MoE layer (ep_output="scattered", default); Replicate() with "replicated" | all_to_all 3M (emulating DeepEP dispatch/combine); see `expected_collectives` |
| `dp-attention` | SGLang `--enable-dp-attention` (DeepSeek-V3 serving) | each rank its own sequence         | sum-len (default): all_reduce 2L, all_gather 1; max-len: all_gather L + 1, reduce_scatter L; vocab-parallel head (default) + all_reduce 1, all_gather 1 |
| `tp` + `tbo`   | SGLang `--enable-two-batch-overlap` (tpsim.modes.tbo) | Replicate(); layers f..L-1 (f = first_k_dense_replace) as two micro-batches | all_reduce 1 + 2f + 4(L - f); all_gather 1 |
| `cp`           | SGLang `--enable-nsa-prefill-context-parallel` (DeepSeek V3.2), pure CP | Shard(dim=0), contiguous token chunks; weights whole on each rank | all_gather L (KV cache rows) + 1 (final norm output); no all_reduce |

Capture strategies (the first of each mode is the right one; the others are what a naive
capture gets):

| mode           | strategies                | what they capture                                                    |
|----------------|---------------------------|----------------------------------------------------------------------|
| `tp`           | model-level, in-layer     | both `hidden_states + residual`, full and replicated; under `tbo` only before layers < first_k_dense_replace (SGLang's capture loop) |
| `tp` + `tbo`   | micro-batches             | each micro-batch's boundary states in the split layers, rows concatenated in token order (sglang PR #32680) |
| `ar-fusion`    | in-layer, model-level     | in-layer: the residual after the fused all-reduce + add (SGLang PR #28343); model-level: `hidden + residual` between layers, per-rank partial sums when fused |
| `sp`, `ep`, `cp` | gathered, local         | gathered: all tokens, all-gathered; local: this rank's token shard     |
| `dp-attention` | local                     | this rank's own sequence at full width (what its rank-local draft uses) |

Each mode is a class (tpsim.modes.kinds) that declares where the residual stream and the
activations live at each stage of a layer (tpsim.modes.stages: SGLang's LayerScatterModes) and
moves them between stages through one transition, `Stream.move`.
"""

from tpsim.modes.base import (DEFAULT_DP_PADDING, DEFAULT_FUSION_MAX_TOKENS, DP_LOCAL_TOKENS, DP_PADDINGS, EP_OUTPUTS,
                              DpLocalTokens, DpPadding, EpOutput, Mode, expected_collectives)
from tpsim.modes.kinds import ArFusion, ContextParallel, DpAttention, ExpertParallel, SequenceParallel, TensorParallel
from tpsim.modes.stages import Plan, Stages, Stream, split_sizes
from tpsim.modes.strategy import Strategy

KINDS = Mode.kinds()  # TensorParallel, ArFusion, SequenceParallel, ExpertParallel, DpAttention, ContextParallel
STRATEGIES = {kind.name: kind.strategies for kind in KINDS}
MODES = tuple(STRATEGIES)

__all__ = ["Strategy", "EpOutput", "DEFAULT_DP_PADDING", "DEFAULT_FUSION_MAX_TOKENS", "DP_PADDINGS", "DpPadding", "DP_LOCAL_TOKENS", "DpLocalTokens", "EP_OUTPUTS", "MODES", "STRATEGIES", "KINDS", "Mode", "expected_collectives",
           "ArFusion", "ContextParallel", "DpAttention", "ExpertParallel", "SequenceParallel", "TensorParallel", "Plan", "Stages",
           "Stream", "split_sizes"]
