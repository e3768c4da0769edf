"""SGLang's two-batch overlap (`--enable-two-batch-overlap`), as tpsim replays it in pure TP: which
layers run as two micro-batches, how the tokens are split between them, and what the option refuses.

Sources (sgl-project/sglang):
- python/sglang/srt/models/deepseek_v2.py@3e4a39ee73308590c5c753108bdcb8d333f7f1c6
  (`DeepseekV2Model.forward`): `if forward_batch.can_run_tbo:` and `start_layer <
  first_k_dense_replace < end_layer`, `normal_end_layer = self.first_k_dense_replace`; the capture loop
  runs `for i in range(normal_start_layer, normal_end_layer)`, then `model_forward_maybe_tbo(layers=
  self.layers[normal_end_layer:self.end_layer], ...)` runs the rest, outside it. With
  first_k_dense_replace = 0 (and one pipeline stage) neither test holds: no layer runs split.
- python/sglang/srt/batch_overlap/two_batch_overlap.py@0099dee6aa65cb084e4b97956dd547519f3d8053:
  a prefill (EXTEND) batch of one sequence has `_split_array_by_balanced_sum([T]) = 0`, so the left
  side holds 0 < T * tbo_token_distribution_threshold (server default 0.48) tokens and the "two chunk"
  split cuts the sequence itself: `compute_split_token_index` returns `sum(extend_seq_lens) // 2`.
  That version falls back to a sequence-boundary split when micro-batch A would get fewer query
  tokens than sequences (`child_a_batch_size > overall_sum // 2`), i.e. a single sequence of fewer
  than 2 tokens; tpsim refuses that case. (Older revisions at python/sglang/srt/two_batch_overlap.py
  have the same `// 2` two-chunk cut without that fallback.)
"""

from __future__ import annotations

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.config.families import MoeLayout


def tbo_split(T: int) -> tuple[int, int]:
    """Tokens of micro-batch A (the first) and B of a single sequence of T tokens (SGLang's two-chunk
    split: A gets T // 2, B the rest)."""
    return T // 2, T - T // 2


def not_in_mode(mode: str) -> UsageError:
    """`--tbo` given with a mode that has no two-batch overlap (tp is the one that has it)."""
    return UsageError(f"--tbo replays SGLang's two-batch overlap in pure TP only: use --mode tp, not --mode {mode}")


def check_tbo(cfg: ModelConfig, tokens: int | None) -> None:
    """Raise UsageError unless `--tbo` can replay SGLang's two-batch overlap on `cfg`."""
    L, f = cfg.num_hidden_layers, cfg.first_k_dense_replace
    if cfg.family.moe is not MoeLayout.DEEPSEEK or cfg.moe_layer_count() == 0:
        raise UsageError(f"--tbo needs a DeepSeek-family model with MoE layers (SGLang splits the batch from "
                         f"first_k_dense_replace on); model_type {cfg.model_type} with "
                         f"{cfg.moe_layer_count()} MoE layers has none")
    if not 0 < f < L:
        raise UsageError(f"--tbo: first_k_dense_replace={f} leaves no layer to split on {L} layers (SGLang's "
                         f"DeepseekV2Model.forward splits only when 0 < first_k_dense_replace < {L})")
    if tokens is not None and tokens < 2:
        raise UsageError(f"--tbo splits the sequence into two micro-batches and needs at least 2 tokens, got "
                         f"{tokens}; pass more --tokens or a larger --seq-len")
