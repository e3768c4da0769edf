"""Communication modes: how the engine being replayed moves activations between ranks.

Every mode computes the same model; they differ in where the residual stream lives between
layers and which collectives move it (L layers, M of them MoE, D = L - M dense, tp > 1;
`expected_collectives` is the formula in code, and `check` compares it with the real trace):

| mode           | engine setting it replays                         | residual stream between layers     | collectives per forward |
|----------------|---------------------------------------------------|------------------------------------|-------------------------|
| `tp`           | SGLang/vLLM `--tp N`                               | Replicate()                        | all_reduce 1 + 2L; all_gather 1 (logits) |
| `ar-fusion`    | SGLang `--enable-flashinfer-allreduce-fusion`      | Partial(sum) hidden + Replicate() residual after layers 0..L-2 when T <= fusion_max_tokens | as `tp`, but layer k's MLP all-reduce runs in layer k+1's input_layernorm |
| `sp`           | Megatron sequence parallelism                      | Shard(dim=0) (tokens padded to a multiple of tp) | reduce_scatter 1 + 2L; all_gather 2L + 2; no all_reduce |
| `ep`           | SGLang `--moe-a2a-backend deepep` / `--ep N`       | Replicate(); with `ep_output="scattered"` Shard(dim=0) after the first MoE layer | all_to_all 3M; see `expected_collectives` |
| `dp-attention` | SGLang `--enable-dp-attention` (DeepSeek-V3 serving) | each rank its own sequence         | all_gather L + 1; reduce_scatter L; no all_reduce |

Capture strategies (the first of each mode is the right one; the others are what a naive
capture gets):

| mode           | strategies                | what they capture                                                    |
|----------------|---------------------------|----------------------------------------------------------------------|
| `tp`           | model-level, in-layer     | both `hidden_states + residual`, full and replicated                 |
| `ar-fusion`    | in-layer, model-level     | in-layer: the residual after the fused all-reduce + add (SGLang PR #28343); model-level: `hidden + residual` between layers, per-rank partial sums when fused |
| `sp`, `ep`     | gathered, local           | gathered: all tokens, all-gathered; local: this rank's token shard     |
| `dp-attention` | local                     | this rank's own sequence at full width (what its rank-local draft uses) |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tpsim.config import ModelConfig
from tpsim.errors import UsageError

STRATEGIES = {
    "tp": ("model-level", "in-layer"),
    "ar-fusion": ("in-layer", "model-level"),
    "sp": ("gathered", "local"),
    "ep": ("gathered", "local"),
    "dp-attention": ("local",),
}
MODES = tuple(STRATEGIES)
EP_OUTPUTS = ("replicated", "scattered")
DEFAULT_FUSION_MAX_TOKENS = 2048  # SGLang's FUSE_ALLREDUCE_MAX_BATCH_SIZE


@dataclass(frozen=True)
class Mode:
    """A communication mode and its options (plain values: it travels to every rank)."""

    name: str = "tp"
    fusion_max_tokens: int = DEFAULT_FUSION_MAX_TOKENS  # ar-fusion: fuse only when T <= this
    ep_output: str = "replicated"  # ep: the MoE output all-gathered, or left token-scattered

    def __post_init__(self):
        if self.name not in STRATEGIES:
            raise UsageError(f"unknown --mode {self.name!r}; use one of {', '.join(MODES)}")
        if self.fusion_max_tokens < 1:
            raise UsageError(f"--fusion-max-tokens {self.fusion_max_tokens} must be at least 1 "
                             f"(SGLang's default is {DEFAULT_FUSION_MAX_TOKENS})")
        if self.ep_output not in EP_OUTPUTS:
            raise UsageError(f"unknown --ep-output {self.ep_output!r}; use one of {', '.join(EP_OUTPUTS)}")

    @property
    def right_strategy(self) -> str:
        return STRATEGIES[self.name][0]

    def strategy(self, name: str | None) -> str:
        """The capture strategy `name` (None: the right one), checked against this mode."""
        if name is None:
            return self.right_strategy
        if name not in STRATEGIES[self.name]:
            raise UsageError(f"capture strategy {name!r} does not exist for --mode {self.name}; "
                             f"use one of {', '.join(STRATEGIES[self.name])}")
        return name

    def check(self, cfg: ModelConfig, tp: int, tokens: int | None = None) -> None:
        """Raise UsageError if this mode cannot run `cfg` at TP=tp (on `tokens` tokens)."""
        cfg.check_tp(tp)
        if self.name == "ep":
            if cfg.n_routed_experts is None or cfg.moe_layer_count() == 0:
                raise UsageError("--mode ep needs MoE layers and this config has none; use --mode tp")
            if cfg.n_routed_experts % tp:
                raise UsageError(f"--mode ep at --tp {tp}: tp does not divide n_routed_experts="
                                 f"{cfg.n_routed_experts} (experts are split whole over ranks); pick a --tp "
                                 f"that divides {cfg.n_routed_experts}")
        if self.name == "dp-attention" and tokens is not None and tokens < tp:
            raise UsageError(f"--mode dp-attention at --tp {tp} gives each rank its own sequence and needs at "
                             f"least {tp} tokens, got {tokens}; pass more --tokens or a larger --seq-len")

    def fused(self, tp: int, tokens: int, k: int, num_layers: int) -> bool:
        """ar-fusion: whether layer k's MLP all-reduce is deferred into layer k+1's norm (SGLang:
        tp > 1, not the last layer, at most fusion_max_tokens tokens in the batch)."""
        return self.name == "ar-fusion" and tp > 1 and k < num_layers - 1 and tokens <= self.fusion_max_tokens

    @property
    def plain(self) -> bool:
        """Pure TP: every collective is an all-reduce (check's table counts just those)."""
        return self.name == "tp"

    @property
    def rank_local(self) -> bool:
        """Each rank runs and captures its own tokens (dp-attention), not the whole batch."""
        return self.name == "dp-attention"

    @staticmethod
    def token_split(T: int, tp: int) -> list[int]:
        """Contiguous split of T tokens over tp ranks, the first T % tp one longer."""
        return [T // tp + (r < T % tp) for r in range(tp)]

    def layers_to_explain(self, k: int, num_layers: int) -> int:
        """How many layers a run explaining layer k builds: 0..k, and under ar-fusion also k+1,
        whose input norm holds layer k's fused all-reduce."""
        return min(num_layers, k + 2) if self.name == "ar-fusion" else k + 1

    def note(self, strategy: str, tokens: int, num_layers: int) -> str | None:
        """What the mode does to this run's capture, in one line (None for plain tp)."""
        if self.plain:
            return None
        L = num_layers
        what = {"ar-fusion": (f"{tokens} tokens <= --fusion-max-tokens {self.fusion_max_tokens}: the MLP all-reduce "
                              f"of layers 0..{L - 2} runs fused in the next layer's input_layernorm"
                              if tokens <= self.fusion_max_tokens else
                              f"{tokens} tokens > --fusion-max-tokens {self.fusion_max_tokens}: no fusion in this "
                              "batch (prefill-sized), every MLP all-reduces in its own layer"),
                "sp": "the residual stream is token-sharded between layers (reduce-scatter / all-gather)",
                "ep": "experts split whole over ranks, tokens moved with all_to_all; the MoE output is "
                      + ("all-gathered" if self.ep_output == "replicated" else "left token-scattered"),
                "dp-attention": "each rank runs its own sequence (the tokens split in rank order); MLP/MoE "
                                "over all ranks"}[self.name]
        return f"mode {self.name}, capture strategy {strategy}: {what}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "Mode":
        return cls(**d) if d else cls()


def expected_collectives(mode: Mode, cfg: ModelConfig, tp: int) -> dict[str, int]:
    """{op: count} of one forward (logits included) in `mode` at TP=tp: the formulas of the
    module docstring, with f the first MoE layer."""
    if tp == 1:
        return {}
    L = cfg.num_hidden_layers
    moe = [k for k in range(L) if cfg.is_moe_layer(k)]
    M, D = len(moe), L - len(moe)
    if mode.name in ("tp", "ar-fusion"):
        return {"all_reduce": 1 + 2 * L, "all_gather": 1}
    if mode.name == "sp":
        return {"reduce_scatter": 1 + 2 * L, "all_gather": 2 * L + 2}
    if mode.name == "dp-attention":
        return {"all_gather": L + 1, "reduce_scatter": L}
    if mode.ep_output == "replicated":  # MoE: 3 all_to_all + 1 all_gather of the outputs
        return {"all_reduce": 1 + L + D, "all_to_all": 3 * M, "all_gather": M + 1}
    f = moe[0]  # scattered: layers after f gather for attention and reduce-scatter its output
    after, dense_after = L - f - 1, sum(1 for k in range(f + 1, L) if not cfg.is_moe_layer(k))
    counts = {"all_reduce": 1 + (f + 1) + (D - dense_after), "all_to_all": 3 * M,
              "all_gather": after + dense_after + 2, "reduce_scatter": after + dense_after}
    return {op: n for op, n in counts.items() if n}
