"""Tensor-parallel layers. Every leaf layer takes its TPGroup and a `prefix` (its Hugging Face
module name, used for the collective trace and for weight names) and lists the full-size
tensors it loads with `weight_specs()`; a layer with named points declares them in `POINTS`
and taps them through the model's Probe (tpsim.layers.probe)."""

from tpsim.layers.attention import MLA
from tpsim.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tpsim.layers.gqa import GQA, AttentionShape
from tpsim.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                 RowParallelLinear, WeightSpec)
from tpsim.layers.mlp import DenseMLP
from tpsim.layers.moe import MoE, MoEGate
from tpsim.layers.norm import RMSNorm
from tpsim.layers.probe import NamedPoint, Point, Probe, Rows, Sink, Tapped, point_name
from tpsim.layers.rope import DeepseekRotaryEmbedding, NeoxRotaryEmbedding

__all__ = ["MLA", "GQA", "AttentionShape", "QKVParallelLinear", "NeoxRotaryEmbedding", "ParallelLMHead", "VocabParallelEmbedding", "ColumnParallelLinear",
           "MergedColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "WeightSpec", "DenseMLP",
           "MoE", "MoEGate", "RMSNorm", "NamedPoint", "Point", "Probe", "Rows", "Sink", "Tapped", "point_name",
           "DeepseekRotaryEmbedding"]
