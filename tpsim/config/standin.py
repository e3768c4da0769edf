"""A stand-in for a target too big to run here: the same decoder at toy widths.

What decides a capture finding is kept: the family and model_type (the engine's model file), the layer
count and which layers are dense, MoE, sliding or full (the ids' numbering and the layer kinds), whether
the KV heads split or replicate at the TP degree, the router's method and group structure, and the TP
degree itself (every collective of the mode runs as served). What does not is shrunk: the widths, the
head count, the vocabulary and the expert count. Findings then quote the real config's widths.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tpsim.config.checks import check_consistency
from tpsim.config.model import ModelConfig

HEAD_DIM = 8  # even: rope rotates pairs
HIDDEN = 64


@dataclass(frozen=True)
class StandIn:
    real: ModelConfig
    cfg: ModelConfig  # what runs

    @property
    def shrunk(self) -> list[str]:
        """`hidden_size 7168 -> 64`, ... for each field the stand-in changed."""
        fam = self.real.family
        return [f"{fam.hf_name(f.name)} {getattr(self.real, f.name)} -> {getattr(self.cfg, f.name)}"
                for f in dataclasses.fields(ModelConfig)
                if f.name in fam.fields and getattr(self.real, f.name) != getattr(self.cfg, f.name)]

    def line(self, name: str, tp: int) -> str:
        r, s = self.real, self.cfg
        kinds = f"{r.num_hidden_layers - r.moe_layer_count()} dense, {r.moe_layer_count()} MoE" \
            if r.n_routed_experts else "dense"
        experts = f", {r.n_routed_experts} experts -> {s.n_routed_experts}" if r.n_routed_experts else ""
        return (f"{name} is replayed on a stand-in: its {r.num_hidden_layers} layers ({kinds}), model file, numbering "
                f"and TP={tp} kept; hidden_size {r.hidden_size} -> {s.hidden_size}, {r.num_attention_heads} heads -> "
                f"{s.num_attention_heads}{experts} (--json lists every width); widths quoted are the real config's")


def stand_in(cfg: ModelConfig, tp: int) -> StandIn:
    """`cfg` at toy widths, valid at TP=tp (and at TP=1), with everything a finding depends on kept."""
    kv = cfg.kv_heads
    kv_small = tp if cfg.mla or kv % tp == 0 else kv  # KV heads split at this degree, or replicated as served
    heads = math.lcm(tp, kv_small)
    change: dict = {"hidden_size": HIDDEN, "num_attention_heads": heads, "vocab_size": 128 * tp,
                    "intermediate_size": 32 * tp}
    if cfg.num_key_value_heads is not None:
        change["num_key_value_heads"] = heads if cfg.mla else kv_small
    if cfg.mla:
        change.update(kv_lora_rank=32, qk_nope_head_dim=HEAD_DIM * 2, qk_rope_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM * 2)
        if cfg.q_lora_rank is not None:
            change["q_lora_rank"] = 48
    else:
        change["head_dim"] = HEAD_DIM
    if cfg.n_routed_experts is not None:
        groups = cfg.n_group or 1 if cfg.topk_method != "greedy" else 1
        experts = math.lcm(tp, groups)
        while experts // groups < 2 or experts < 2 * min(cfg.num_experts_per_tok, 2):
            experts *= 2
        change.update(n_routed_experts=experts, num_experts_per_tok=min(cfg.num_experts_per_tok, 2),
                      moe_intermediate_size=16 * tp)
    extra = {k: v for k, v in cfg.extra.items() if k != "quantization_config"}  # seeded weights, model dtype
    small = dataclasses.replace(cfg, fp8_block=None, extra=extra, **change)
    if cfg.family.copies:  # GPT-OSS: the experts' width is intermediate_size
        small = dataclasses.replace(small, **{f: getattr(small, src) for f, src in cfg.family.copies.items()})
    check_consistency(small, "the stand-in")
    return StandIn(cfg, small)
