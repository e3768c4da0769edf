"""Linear layers in the vLLM/SGLang layout. Weights are `[out, in]`, `y = x W^T (+ b)`.

| layer                        | this rank's weight                   | communication          |
|------------------------------|--------------------------------------|------------------------|
| ReplicatedLinear             | `[out, in]`                          | none                   |
| ColumnParallelLinear         | rows `[r*out/tp, (r+1)*out/tp)`      | none (output Shard(-1))|
| MergedColumnParallelLinear   | each logical matrix's rows, stacked  | none                   |
| QKVParallelLinear            | its query heads; its KV heads, or the one KV head its query heads use when tp > KV heads | none |
| RowParallelLinear            | columns `[r*in/tp, (r+1)*in/tp)`     | one all-reduce         |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from tpsim.layers.fp8 import FP8, BlockFp8, linear, scale_shape
from tpsim.layers.probe import Point, Probe, Tapped, point_name
from tpsim.parallel.placement import P, R
from tpsim.parallel.group import TPGroup


@dataclass
class WeightSpec:
    """One tensor of the Hugging Face checkpoint: its name, full shape, and how this rank
    copies its slice into its parameter.

    `load(src)` indexes `src` with plain slices (`src[a:b]`, `src[:, a:b]`, `src[:]`) and
    copies the result: `src` is either the full tensor (seeded weights) or a lazy
    checkpoint slice (safetensors `get_slice`), so a rank reads only its part of the file.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]


def divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"tp={d} does not divide {what}={n}")
    return n // d


def _copy(param: "torch.Tensor | BlockFp8", src: "torch.Tensor | BlockFp8") -> None:
    """Copy a (sliced) source tensor into a parameter, casting to its dtype and device (into FP8
    blocks: the source's FP8 values and scales, or the source quantized)."""
    assert tuple(param.shape) == tuple(src.shape), (param.shape, src.shape)
    if isinstance(param, BlockFp8):
        param.copy_(src)
        return
    if isinstance(src, BlockFp8):  # an fp8 checkpoint tensor into a parameter kept in the model dtype
        src = src.dequantize()
    with torch.no_grad():
        param.copy_(src)


def fp8_parameters(module: nn.Module, shape: tuple[int, ...], block: tuple[int, int], device) -> None:
    """Give `module` an FP8 `weight` of `shape` and its float32 `weight_scale_inv` (one per block)."""
    module.weight = nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)
    scales = (*shape[:-2], *scale_shape(tuple(shape[-2:]), block))
    module.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.float32, device=device),
                                           requires_grad=False)


class _Linear(nn.Module):
    """`fp8`: the weight kept in float8_e4m3fn blocks of this (rows, cols) shape with their scales
    (`w` is then a BlockFp8); None: in `dtype`."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, prefix: str,
                 dtype: torch.dtype, bias: bool, local_shape: tuple[int, int], fp8: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.prefix, self.fp8 = group, prefix, fp8
        if fp8 is None:
            self.weight = nn.Parameter(torch.empty(local_shape, dtype=dtype, device=group.device), requires_grad=False)
        else:
            fp8_parameters(self, local_shape, fp8, group.device)
        self.bias = None
        if bias:
            n = local_shape[0] if isinstance(self, (ColumnParallelLinear,)) else out_features
            self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=group.device), requires_grad=False)

    @property
    def w(self) -> "torch.Tensor | BlockFp8":
        """The weight as the forward multiplies by it (FP8 blocks with their scales, or a tensor)."""
        return self.weight if self.fp8 is None else BlockFp8(self.weight, self.weight_scale_inv, self.fp8)

    def forward(self, x):
        return linear(x, self.w, self.bias)


class ReplicatedLinear(_Linear):
    """Full weight on every rank; input and output Replicate()."""

    def __init__(self, in_features, out_features, group, prefix, dtype, bias=False, fp8=None):
        super().__init__(in_features, out_features, group, prefix, dtype, bias, (out_features, in_features), fp8)

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", (self.out_features, self.in_features),
                         lambda t: _copy(self.w, t[:]))
        if self.bias is not None:
            yield WeightSpec(f"{self.prefix}.bias", (self.out_features,), lambda t: _copy(self.bias, t[:]))


class ColumnParallelLinear(_Linear):
    """Output features split contiguously: `[T, in]` Replicate() → `[T, out/tp]` Shard(-1)."""

    def __init__(self, in_features, out_features, group, prefix, dtype, bias=False, fp8=None):
        self.out_per_rank = divide(out_features, group.size, f"{prefix} output size")
        super().__init__(in_features, out_features, group, prefix, dtype, bias, (self.out_per_rank, in_features), fp8)

    def _rows(self, t):
        start = self.group.rank * self.out_per_rank
        return t[start:start + self.out_per_rank]

    def weight_specs(self):
        yield WeightSpec(f"{self.prefix}.weight", (self.out_features, self.in_features),
                         lambda t: _copy(self.w, self._rows(t)))
        if self.bias is not None:
            yield WeightSpec(f"{self.prefix}.bias", (self.out_features,), lambda t: _copy(self.bias, self._rows(t)))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several logical column-parallel matrices in one GEMM (gate_up_proj = [gate; up]).

    Each logical matrix is split separately, so rank r holds `[gate rows of r ; up rows of r]`:
    a contiguous split of the concatenation would pair the wrong rows.
    """

    def __init__(self, in_features, output_sizes: list[int], group, prefix, dtype, hf_names: list[str], fp8=None):
        self.output_sizes, self.hf_names = list(output_sizes), list(hf_names)
        self.sizes_per_rank = [divide(o, group.size, f"{prefix} output size") for o in output_sizes]
        super().__init__(in_features, sum(output_sizes), group, prefix, dtype, bias=False, fp8=fp8)

    def weight_specs(self):
        offset = 0
        for name, size, local in zip(self.hf_names, self.output_sizes, self.sizes_per_rank):
            def load(t, offset=offset, local=local):
                start = self.group.rank * local
                _copy(self.w[offset:offset + local], t[start:start + local])
            yield WeightSpec(name, (size, self.in_features), load)
            offset += local


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj in one GEMM, split by heads (vLLM `QKVParallelLinear`,
    vllm/model_executor/layers/linear.py @v0.33.0): each rank holds `heads/tp` query heads; KV
    heads are split (`kv_heads/tp` each) while tp <= kv_heads, and replicated beyond: each rank
    holds the one KV head its query heads use, `kv_heads/tp` replicas of each (rank r holds KV head
    `r // (tp/kv_heads)`). Output `[T, (q + 2 kv) * head_dim]`: `[q | k | v]` of this rank's heads."""

    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, group, prefix: str, dtype,
                 bias: bool = False, fp8: tuple[int, int] | None = None):
        tp = group.size
        self.heads, self.head_dim = divide(heads, tp, "num_attention_heads"), head_dim
        if tp >= kv_heads:
            self.kv_heads, self.kv_shard = 1, group.rank // divide(tp, kv_heads, "the TP degree over num_key_value_heads")
        else:
            self.kv_heads = divide(kv_heads, tp, "num_key_value_heads")
            self.kv_shard = group.rank
        self.total_heads, self.total_kv_heads = heads, kv_heads
        sizes = [self.heads * head_dim, self.kv_heads * head_dim, self.kv_heads * head_dim]
        self.offsets = [0, sizes[0], sizes[0] + sizes[1]]
        self.hf = [(f"{prefix.rsplit('.', 1)[0]}.{n}", size, total * head_dim, shard)
                   for n, size, total, shard in (("q_proj", sizes[0], heads, group.rank),
                                                 ("k_proj", sizes[1], kv_heads, self.kv_shard),
                                                 ("v_proj", sizes[2], kv_heads, self.kv_shard))]
        _Linear.__init__(self, hidden, sum(sizes) * tp, group, prefix, dtype, bias, (sum(sizes), hidden), fp8)
        self.out_per_rank = sum(sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return y.split([q, k, k], dim=-1)

    def weight_specs(self):
        for (name, size, full, shard), offset in zip(self.hf, self.offsets):
            def rows(t, size=size, shard=shard):
                return t[shard * size:(shard + 1) * size]
            yield WeightSpec(f"{name}.weight", (full, self.in_features),
                             lambda t, o=offset, n=size, rows=rows: _copy(self.w[o:o + n], rows(t)))
            if self.bias is not None:
                yield WeightSpec(f"{name}.bias", (full,),
                                 lambda t, o=offset, n=size, rows=rows: _copy(self.bias[o:o + n], rows(t)))


class RowParallelLinear(Tapped, _Linear):
    """Input features split: `[T, in/tp]` Shard(-1) → partial `[T, out]` → all-reduce →
    Replicate(). The bias is added once, after the reduce. With `reduce_results=False` the
    caller reduces the partial sum and taps these points."""

    POINTS = (Point("partial", P, "{module} output before its all-reduce"),
              Point("out", R, "{module} output after its all-reduce"))

    def __init__(self, in_features, out_features, group, prefix, dtype, bias=False, reduce_results=True,
                 probe: Probe | None = None, fp8: tuple[int, int] | None = None):
        self.in_per_rank = divide(in_features, group.size, f"{prefix} input size")
        super().__init__(in_features, out_features, group, prefix, dtype, bias, (out_features, self.in_per_rank), fp8)
        self.reduce_results, self.point, self.probe = reduce_results, point_name(prefix), probe or Probe(group)

    def weight_specs(self):
        start = self.group.rank * self.in_per_rank
        yield WeightSpec(f"{self.prefix}.weight", (self.out_features, self.in_features),
                         lambda t: _copy(self.w, t[:, start:start + self.in_per_rank]))
        if self.bias is not None:
            yield WeightSpec(f"{self.prefix}.bias", (self.out_features,), lambda t: _copy(self.bias, t[:]))

    def add_bias(self, y):
        """The reduced output plus the bias, added once (never to the partial sums: tp times)."""
        return y if self.bias is None else y + self.bias

    def forward(self, x):
        y = linear(x, self.w)
        if not self.reduce_results:  # the caller reduces, then calls add_bias
            return y
        self.tap("partial", y)
        y = self.add_bias(self.group.all_reduce(y, self.prefix))
        self.tap("out", y)
        return y
