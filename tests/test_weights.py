"""Seeded weights (tpsim/weights/seeded.py): the counter-based generator is deterministic, independent
across names and seeds, chunking-free, matches its pure-Python reference, has the intended
distribution and per-name scaling, and gives the same bits on CUDA as on the CPU (`-m gpu`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim.weights import seeded as W
from tpsim.config.loader import load_config
from tpsim.model.decoder import CausalLM
from tpsim.parallel.group import TPGroup

ROOT = Path(__file__).resolve().parent.parent

NAMES = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
         "model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.kv_a_layernorm.weight",
         "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.0.self_attn.o_proj.weight",
         "model.layers.2.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate_proj.bias"]
seeds = st.integers(0, 2**64)
names = st.one_of(st.sampled_from(NAMES), st.text(max_size=30))
shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)

SQRT3 = math.sqrt(3)


def sums(seed: int, name: str, n: int, first: int = 0, chunk: int = 1 << 14, device="cpu") -> torch.Tensor:
    """sum_j u_j - centre for flat indices [first, first + n): exact integers in float32."""
    out = torch.empty(n, device=device)
    W._fill(out, W.tensor_seed(seed, name), 1.0, 0.0, chunk, first)
    return out


@given(seeds, names, shapes, st.integers(1, 40), st.integers(0, 5))
def test_deterministic_and_chunk_free(seed, name, shape, pieces, extra):
    """Same (seed, name, shape): the same bits, in whatever chunks (a divisor of the size or
    not: about `pieces` chunks, `extra` elements longer than an exact split)."""
    x = W.init_tensor(seed, name, shape)
    assert x.shape == shape and x.dtype == torch.float32 and x.device.type == "cpu"
    assert torch.equal(x, W.init_tensor(seed, name, list(shape)))
    chunk = -(-x.numel() // pieces) + extra
    assert torch.equal(x, W.init_tensor(seed, name, shape, chunk=chunk))


BOUNDARY = st.builds(lambda block, d: max(0, (block << 32) + d), st.integers(1, 3), st.integers(-70, 10))


@given(seeds, names, st.one_of(st.integers(0, 2**40), BOUNDARY), st.integers(1, 70), st.integers(1, 50))
@settings(max_examples=50)
def test_matches_python_reference(seed, name, first, n, chunk):
    """Elements [first, first + n) of the flat stream equal the pure-Python reference whatever
    the chunk size, past 2^32 too (the index's high bits go into the keys; a chunk straddling
    a 2^32 block boundary is split there)."""
    got = sums(seed, name, n, first, chunk)
    key = W.tensor_seed(seed, name)
    assert got.tolist() == [float(W._reference_sum(key, i)) for i in range(first, first + n)]


def test_block_boundary_example():
    got = sums(3, "x", 40, (1 << 32) - 20, chunk=7)
    key = W.tensor_seed(3, "x")
    assert got.tolist() == [float(W._reference_sum(key, i)) for i in range((1 << 32) - 20, (1 << 32) + 20)]
    # the second block is not the first one again
    assert not torch.equal(sums(3, "x", 64, 1 << 32), sums(3, "x", 64, 0))


@given(seeds, names, seeds, names)
@settings(max_examples=50)
def test_names_and_seeds_independent(seed_a, name_a, seed_b, name_b):
    if (seed_a, name_a) == (seed_b, name_b) or W.tensor_seed(seed_a, name_a) == W.tensor_seed(seed_b, name_b):
        return
    a, b = sums(seed_a, name_a, 4096), sums(seed_b, name_b, 4096)
    assert not torch.equal(a, b)
    assert torch.isin(a, b).float().mean() < 0.01  # not a shifted or permuted copy either
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.1


def test_pinned_values():
    """The generator is a format: a change here re-seeds every model and exported checkpoint."""
    x = W.init_tensor(0, "model.embed_tokens.weight", (2, 3)).flatten().tolist()
    assert x == [float.fromhex(h) for h in ["-0x1.02b32p-4", "-0x1.6267bp-1", "0x1.087dfep+1", "0x1.b172a4p-2",
                                           "0x1.adbb0ap+0", "0x1.8ded06p+0"]]
    y = W.init_tensor(1234, "model.layers.0.self_attn.o_proj.weight", (4, 128)).flatten()[:3].tolist()
    assert y == [float.fromhex(h) for h in ["0x1.914b9ap-7", "0x1.d5fedep-5", "0x1.df4e38p-5"]]


def test_same_name_different_shape_shares_prefix():
    """The values are a function of (seed, name, flat index): a shape only says how many."""
    assert torch.equal(W.init_tensor(1, "model.embed_tokens.weight", (7, 5)).flatten(),
                       W.init_tensor(1, "model.embed_tokens.weight", (35,)))


@given(seeds, names)
@settings(max_examples=10)
def test_unit_core_distribution(seed, name):
    """z = sqrt(3) * (Irwin-Hall(4) - 2): mean 0, variance 1, kurtosis 2.7, |z| < 2 sqrt(3),
    neighbours uncorrelated."""
    n = 1 << 16
    s = sums(seed, name, n)
    z = (s * (SQRT3 / (1 << W._BITS))).double()
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1) < 0.02
    assert abs((z ** 4).mean() / z.var() ** 2 - 2.7) < 0.15
    assert z.abs().max() < 2 * SQRT3
    assert s.abs().max() <= W._CENTRE
    assert abs(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1]) < 0.03
    assert abs(torch.corrcoef(torch.stack([z[:-4], z[4:]]))[0, 1]) < 0.03
    # the 22-bit uniforms: every value of the sum is an integer, and both parities occur
    assert torch.equal(s, s.round()) and (s % 2 == 1).any() and (s % 2 == 0).any()


KINDS = [("model.layers.3.post_attention_layernorm.weight", (256,), 0.1, 1.0),
         ("model.layers.3.mlp.gate.e_score_correction_bias", (256,), 0.05, 0.0),
         ("model.embed_tokens.weight", (300, 48), 1.0, 0.0),
         ("model.layers.3.mlp.gate_proj.bias", (512,), 1.0, 0.0),
         ("model.layers.3.self_attn.q_proj.weight", (48, 300), 300 ** -0.5, 0.0),
         ("lm_head.weight", (30, 64), 1 / 8, 0.0)]


@given(seeds, st.sampled_from(KINDS))
@settings(max_examples=30)
def test_scaling_per_name(seed, kind):
    """offset + factor * z, exactly as one float32 multiply (factor * sqrt(3) / 2^22 rounded to
    float32) and, for norms, one add."""
    name, shape, factor, offset = kind
    x = W.init_tensor(seed, name, shape)
    s = sums(seed, name, math.prod(shape)).view(shape)
    expect = s * W._float32(factor * SQRT3 / (1 << W._BITS))
    if offset:
        expect = expect + offset
    assert torch.equal(x, expect)
    if math.prod(shape) >= 4096:
        assert abs(x.mean() - offset) < 6 * factor / math.sqrt(x.numel())
        assert abs(x.std() / factor - 1) < 0.05
    assert (x - offset).abs().max() < 2 * SQRT3 * factor


def test_init_random_weights_meta_and_cpu():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    meta = CausalLM(cfg, TPGroup(device=torch.device("meta")), torch.bfloat16)
    assert W.model_device(meta) == torch.device("cpu")
    W.init_random_weights(meta, 0)  # generating for a meta model is pointless but harmless
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert W.model_device(torch.nn.Module()) == torch.device("cpu")
    model = CausalLM(cfg, TPGroup(), torch.float32)
    assert W.model_device(model) == torch.device("cpu")
    W.init_random_weights(model, 5)
    assert torch.equal(model.model.norm.weight, W.init_tensor(5, "model.norm.weight", (cfg.hidden_size,)))
    embed = W.init_tensor(5, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    assert torch.equal(model.model.embed_tokens.weight[:cfg.vocab_size], embed)


@pytest.mark.parametrize("name,shape", [("model.embed_tokens.weight", (1000, 64)), ("model.norm.weight", (7168,)),
                                        ("model.layers.0.mlp.gate.e_score_correction_bias", (256,)),
                                        ("model.layers.5.mlp.experts.3.down_proj.weight", (2048, 1408)),
                                        ("model.layers.0.self_attn.kv_b_proj.weight", (4097, 1025)),
                                        ("x", (1,)), ("y", (0, 3))])
@pytest.mark.parametrize("chunk", [None, 1000])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on a GPU node with pytest -m gpu")
def test_cuda_bitwise_equals_cpu(name, shape, chunk):
    cpu = W.init_tensor(11, name, shape)
    gpu = W.init_tensor(11, name, shape, "cuda", chunk=chunk)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on a GPU node with pytest -m gpu")
def test_cuda_block_boundary_equals_cpu():
    first = (1 << 32) - 1000
    assert torch.equal(sums(2, "z", 5000, first, 999, "cuda").cpu(), sums(2, "z", 5000, first, 777))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on a GPU node with pytest -m gpu")
def test_cuda_seeded_model_equals_cpu(dtype, monkeypatch):
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    cpu = CausalLM(cfg, TPGroup(), dtype)
    W.init_random_weights(cpu, 7)
    gpu = CausalLM(cfg, TPGroup(device=torch.device("cuda")), dtype)
    devices = []
    real = W._fill  # where every seeded element is generated, into the tensor it is handed

    def spy(out, *args, **kw):
        devices.append(out.device.type)
        return real(out, *args, **kw)

    monkeypatch.setattr(W, "_fill", spy)
    W.init_random_weights(gpu, 7)
    assert devices and set(devices) == {"cuda"}  # generated on the GPU, not copied from the CPU
    p_cpu, p_gpu = dict(cpu.named_parameters()), dict(gpu.named_parameters())
    assert p_cpu.keys() == p_gpu.keys()
    for k, v in p_gpu.items():
        assert v.device.type == "cuda" and v.dtype == dtype
        assert torch.equal(v.cpu(), p_cpu[k]), k


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), name=st.sampled_from(["model.embed_tokens.weight", "lm_head.weight",
                                                         "model.norm.weight", "model.layers.0.mlp.experts.gate_up_proj"]),
       shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_seeded_source_slices_equal_the_full_tensor(seed, name, shape, data):
    """A rank generates only the rows it keeps (W.SeededSource); every slice a loader takes (rows,
    rows x columns, one index, everything) equals that slice of the full tensor, bit for bit."""
    full = W.init_tensor(seed, name, tuple(shape))
    src = W.SeededSource(seed, name, tuple(shape), torch.device("cpu"))
    a = data.draw(st.integers(0, shape[0]), label="row start")
    b = data.draw(st.integers(a, shape[0]), label="row stop")
    assert torch.equal(src[a:b], full[a:b])
    assert torch.equal(src[:], full[:])
    if a < shape[0]:
        assert torch.equal(src[a], full[a])
    if len(shape) > 1:
        c = data.draw(st.integers(0, shape[1]), label="column start")
        assert torch.equal(src[a:b, c:], full[a:b, c:])
