"""Seeded weights: master weight then split.

Every tensor of the Hugging Face checkpoint is generated full size, in float32, from a
counter-based hash of (model seed, tensor name, element index), then each rank copies its
slice. So TP=1 and TP=8 hold bit-identical weights, and one tensor's values never depend on
which other tensors exist.

The generator gives the same bits on every device, so `init_random_weights` generates on the
model's device (a GPU seeds a full-size model far faster than the CPU) and a GPU-seeded
model is bit-identical to a CPU-seeded one. torch's own generators cannot do that (the CPU's
is MT19937, CUDA's Philox, and the log/cos/sqrt of a normal sampler differ by an ulp
between CPU and CUDA libm), so the generator is plain torch integer ops, exact everywhere,
followed by exactly rounded float32 ops:

- the tensor's key `tensor_seed(seed, name)` and the block `i >> 32` of the flat (row-major)
  index give, through SHA-256, an odd 32-bit multiplier A and four 32-bit stream keys B_j;
- b = (i mod 2^32) * A mod 2^32, and u_j = lowbias32(b ^ B_j) >> 10, four 22-bit uniforms
  (lowbias32: Chris Wellons' 32-bit integer hash);
- z = sqrt(3) * (sum_j (u_j + 1/2) / 2^22 - 2): Irwin-Hall of four uniforms, centred, unit
  variance, |z| < 2 sqrt(3). It is computed as float32(sum_j u_j - (2^23 - 2)), an exact
  integer, times one float32 constant that also holds the per-name scale below, so each
  value is rounded once (norm weights: once more, adding the 1).

The 32-bit values live in int64 tensors, masked to 32 bits after each multiply, and every
multiplier is below 2^31 in magnitude, so nothing overflows int64; only +, -, *, &, ^ and
right shifts of non-negative values are used, and the float ops are separate torch ops
(no fused multiply-add). Values do not depend on the chunking (`chunk`), which only bounds
the temporaries.
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from contextlib import nullcontext

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D  # lowbias32's multipliers
_C2 = 0x846CA68B
_C2_INT64 = _C2 - (1 << 32)  # the same residue mod 2^32, below 2^31 in magnitude: 32-bit value * it fits int64
_BITS = 22  # bits per uniform: a sum of four is below 2^24, so it is exact in float32
_CENTRE = 2 * ((1 << _BITS) - 1)
_UNIT = math.sqrt(3) / (1 << _BITS)  # z = _UNIT * (sum_j u_j - _CENTRE)
_CHUNK_CPU = 1 << 14  # elements per step and CPU thread: the temporaries (10.5 int64 words an element) stay in L2
_CHUNK_DEVICE = 1 << 22  # on a GPU: few kernel launches, about 350 MB of temporaries


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _float32(v: float) -> float:
    """`v` rounded to float32, so a torch op casting the scalar to float32 is exact on every device."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _block_keys(key: int, block: int) -> tuple[int, list[int]]:
    """The odd multiplier A and the four stream keys B_j of block `block` (flat indices
    [block * 2^32, (block + 1) * 2^32)) of the tensor with key `key`. The 160 key bits keep
    tensors from being shifted copies of each other (a 32-bit key XORed into the index would:
    with ~10^5 tensors, many pairs have keys differing only in bits below their size)."""
    d = hashlib.sha256(key.to_bytes(8, "little") + block.to_bytes(8, "little")).digest()
    w = [int.from_bytes(d[4 * k:4 * k + 4], "little") for k in range(5)]
    return w[0] | 1, w[1:]


def _lowbias32(x: int) -> int:
    """The hash on a Python int (the reference the tensor code must match)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def _reference_sum(key: int, i: int) -> int:
    """sum_j u_j - _CENTRE for flat index `i`, in pure Python: z = _UNIT * this."""
    a, b = _block_keys(key, i >> 32)
    base = ((i & _M32) * a) & _M32
    return sum(_lowbias32(base ^ bj) >> (32 - _BITS) for bj in b) - _CENTRE


def _scaling(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(factor, offset): the tensor is offset + factor * z, z ~ unit variance."""
    if name.endswith("norm.weight"):
        return 0.1, 1.0
    if name.endswith("e_score_correction_bias"):
        return 0.05, 0.0
    if name.endswith("embed_tokens.weight") or len(shape) <= 1:
        return 1.0, 0.0
    if len(shape) == 3:  # stacked experts, transformers' layout [E, in, out] (GPT-OSS gate_up_proj, down_proj)
        return 1 / shape[-2] ** 0.5, 0.0
    return 1 / shape[-1] ** 0.5, 0.0


def _fill(out: torch.Tensor, key: int, mul: float, add: float, chunk: int, first: int = 0, tick=None) -> None:
    """out (flat float32) [k] = add + mul * (sum_j u_j(first + k) - _CENTRE), `chunk` elements a step."""
    n, dev = out.numel(), out.device
    m = max(1, min(chunk, n))
    i64 = dict(dtype=torch.int64, device=dev)
    idx, x, t = torch.empty(m, **i64), torch.empty(4 * m, **i64), torch.empty(4 * m, **i64)
    s64, s32 = torch.empty(m, **i64), torch.empty(m, dtype=torch.int32, device=dev)
    start, end = first, first + n
    while start < end:
        block = start >> 32
        stop = min(end, (block + 1) << 32)
        a, b = _block_keys(key, block)
        a = a - (1 << 32) if a >> 31 else a  # same residue, |a| < 2^31: an index below 2^32 times it fits int64
        # lowbias32 starts with x ^= x >> 16, and (b ^ B) >> 16 == (b >> 16) ^ (B >> 16): the
        # shift of the index part is done once for all four streams, the keys' in Python.
        keys = torch.tensor([bj ^ (bj >> 16) for bj in b], **i64).view(4, 1)
        for lo in range(start, stop, m):
            k = min(m, stop - lo)
            i, xs, ts = idx[:k], x[:4 * k].view(4, k), t[:4 * k].view(4, k)
            torch.arange(lo & _M32, (lo & _M32) + k, out=i)
            i.mul_(a).bitwise_and_(_M32)
            torch.bitwise_right_shift(i, 16, out=ts[0])
            i.bitwise_xor_(ts[0])
            torch.bitwise_xor(i, keys, out=xs)
            xs.mul_(_C1).bitwise_and_(_M32)
            torch.bitwise_right_shift(xs, 15, out=ts)
            xs.bitwise_xor_(ts)
            xs.mul_(_C2_INT64).bitwise_and_(_M32)
            # (h ^ (h >> 16)) >> 10, the hash's last step and the top 22 bits, is (h >> 10) ^ (h >> 26)
            torch.bitwise_right_shift(xs, 32 - _BITS + 16, out=ts)
            xs.bitwise_right_shift_(32 - _BITS)
            xs.bitwise_xor_(ts)
            torch.sum(xs, 0, out=s64[:k])
            s32[:k].copy_(s64[:k])  # below 2^24: exact; int32 converts to float faster than int64
            o = out[lo - first:lo - first + k]
            o.copy_(s32[:k])
            o.sub_(float(_CENTRE))  # integers below 2^24: exact
            o.mul_(mul)
            if add:
                o.add_(add)
            if tick is not None:
                tick()
        start = stop


def _default_chunk(device: torch.device) -> int:
    if device.type == "cpu":
        return min(_CHUNK_CPU * torch.get_num_threads(), 1 << 20)
    return _CHUNK_DEVICE


def init_tensor(seed: int, name: str, shape: tuple[int, ...], device: torch.device | str = torch.device("cpu"),
                *, chunk: int | None = None) -> torch.Tensor:
    """The full float32 tensor `name` for model seed `seed`, generated on `device`; the same
    bits on every device and for every `chunk` (elements generated per step).

    Linear weights ~ z/sqrt(fan_in); embeddings ~ z; norm weights ~ 1 + 0.1 z (not all ones,
    so a norm applied to the wrong slice shows); the noaux_tc correction bias ~ 0.05 z; with
    z approximately N(0, 1) (see the module docstring).
    """
    device = torch.device(device)
    shape = tuple(shape)
    out = torch.empty(shape, dtype=torch.float32, device=device)
    factor, offset = _scaling(name, shape)
    if chunk is None:
        chunk = _default_chunk(device)
    if out.numel():
        _fill(out.view(-1), tensor_seed(seed, name), _float32(factor * _UNIT), offset, chunk)
    return out


def weight_specs(module: torch.nn.Module):
    """Every checkpoint tensor a module (a layer or the whole model) loads: the leaf layers'
    WeightSpecs (HF name, full shape, loader into this rank's slice)."""
    for m in module.modules():
        if hasattr(m, "weight_specs"):
            yield from m.weight_specs()


def fill_weights(model: torch.nn.Module, open_source, what: str, progress=None) -> None:
    """Fill every parameter of `model`: `open_source(spec, beat)` is a context manager that gives
    what `spec.load` indexes (a full tensor, or a lazy checkpoint or seeded slice), and may call
    `beat()` while it works. `progress(msg)` hears how far it got every couple of seconds (a
    full-size model takes minutes; the pool's stall watchdog counts silence, not total time)."""
    specs = list(weight_specs(model))
    last, done = [time.monotonic()], [0]

    def beat():
        if progress is not None and time.monotonic() - last[0] > 2:
            progress(f"{what}: {done[0]}/{len(specs)} tensors")
            last[0] = time.monotonic()

    for spec in specs:
        with open_source(spec, beat) as src:
            spec.load(src)
        done[0] += 1
        beat()


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s weights live (its first parameter's device); the CPU for a model
    without parameters or on the meta device (nothing to generate there)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta":
        return torch.device("cpu")
    return p.device


class SeededSource:
    """The seeded tensor `name` as a lazy source: `src[rows]`, `src[rows, cols]` or `src[:]`
    generates only the rows asked for (a vocab-parallel embedding at TP=8 generates an eighth of
    it), the same bits as slicing `init_tensor`'s full tensor. `tick()` is called every chunk."""

    def __init__(self, seed: int, name: str, shape: tuple[int, ...], device: torch.device, tick=None):
        self.key, self.shape, self.device, self.tick = tensor_seed(seed, name), tuple(shape), device, tick
        factor, self.offset = _scaling(name, self.shape)
        self.mul = _float32(factor * _UNIT)

    def __getitem__(self, idx) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if not self.shape:
            return init_tensor_at(self, 0, 1).view(())[idx]
        rows = idx[0] if isinstance(idx[0], slice) else slice(idx[0], idx[0] + 1)
        r0, r1, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("seeded slices must be contiguous")
        r1 = max(r0, r1)
        per_row = math.prod(self.shape[1:])
        block = init_tensor_at(self, r0 * per_row, (r1 - r0) * per_row).view(r1 - r0, *self.shape[1:])
        rest = (slice(None),) + idx[1:]
        return block[rest] if isinstance(idx[0], slice) else block[0][idx[1:]]


def init_tensor_at(src: SeededSource, first: int, n: int) -> torch.Tensor:
    """Elements [first, first + n) of the flat seeded tensor (float32)."""
    out = torch.empty(n, dtype=torch.float32, device=src.device)
    if n:
        _fill(out, src.key, src.mul, src.offset, _default_chunk(src.device), first, src.tick)
    return out


def init_random_weights(model: torch.nn.Module, seed: int, progress=None) -> None:
    """Fill every parameter of a tpsim model or layer (any TP degree) from `seed`, generating
    on the model's device (bit-identical to generating on the CPU) only the rows each rank keeps."""
    device = model_device(model)
    fill_weights(model, lambda spec, beat: nullcontext(SeededSource(seed, spec.name, spec.shape, device, beat)),
                 "seeding weights", progress)
