"""Output integrity: every file tpsim writes carries per-tensor checksums that `tpsim verify`
checks; any change to a tensor's bytes is caught; a truncated file is bad input. Resource
guards: the per-rank memory estimate is what ranks really allocate, and weights that do not
fit are refused before any rank starts."""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import TP_DEGREES, config_dicts
from clirun import run_cli
from tpsim.files.capture import write_capture
from tpsim.checkpoint.export import export_checkpoint
from tpsim.config import config_from_dict, load_config, with_overrides
from tpsim.model import shard_bytes
from tpsim.files.verify import verify_file
from tpsim.testing.jobs import param_bytes_job

ROOT = Path(__file__).resolve().parents[1]


def data_offset(path: Path) -> int:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


@settings(max_examples=60)
@given(T=st.integers(1, 6), width=st.integers(1, 40), data=st.data())
def test_any_flipped_data_byte_is_caught(tmp_path_factory, T, width, data):
    path = tmp_path_factory.mktemp("v") / "c.safetensors"
    write_capture(path, torch.randn(T, width), list(range(T)), {"positions": "out(1)"})
    assert verify_file(path) == []
    raw = bytearray(path.read_bytes())
    i = data.draw(st.integers(data_offset(path), len(raw) - 1), label="byte")
    raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    path.write_bytes(bytes(raw))
    problems = verify_file(path)
    assert len(problems) == 1 and "checksum mismatch" in problems[0]


def test_verify_cli_on_everything_tpsim_writes(tmp_path):
    cfg = with_overrides(load_config(ROOT / "configs/tiny.yaml"), ["num_hidden_layers=2"])
    export_checkpoint(cfg, 0, tmp_path / "ckpt", "bfloat16", 64 * 1024)
    cap = tmp_path / "c.safetensors"
    assert run_cli("capture", "--tp", "2", "--points", "layers.1.mlp.partial", "--out", cap).returncode == 0
    write_capture(tmp_path / "cap.safetensors", torch.ones(2, 3), [1, 2], {})
    r = run_cli("verify", tmp_path / "ckpt", tmp_path / "c.rank0.safetensors", tmp_path / "c.rank1.safetensors",
                tmp_path / "cap.safetensors")
    assert r.returncode == 0, r
    assert r.stdout.count("ok   ") == len(list((tmp_path / "ckpt").glob("*.safetensors"))) + 3
    shard = sorted((tmp_path / "ckpt").glob("*.safetensors"))[1]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40
    shard.write_bytes(bytes(raw))
    r = run_cli("verify", tmp_path / "ckpt")
    assert r.returncode == 1 and f"FAIL {shard}: tensor " in r.stdout and "checksum mismatch" in r.stdout, r
    shard.write_bytes(bytes(raw[:-100]))
    r = run_cli("verify", shard)
    assert r.returncode == 2 and "is truncated" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


def test_a_file_without_checksums_is_not_verified(tmp_path):
    from safetensors.torch import save_file
    save_file({"x": torch.ones(2)}, tmp_path / "plain.safetensors")
    r = run_cli("verify", tmp_path / "plain.safetensors")
    assert r.returncode == 1 and "have no checksum" in r.stdout, r


# --- resource guards -------------------------------------------------------------------------


@settings(max_examples=15)
@given(tp=st.sampled_from(TP_DEGREES), data=st.data(), dtype=st.sampled_from(["float32", "bfloat16"]))
def test_the_memory_estimate_is_what_each_rank_allocates(rank_pool, tp, data, dtype):
    cfg = config_from_dict(data.draw(config_dicts(tp), label="config"))
    out = rank_pool.run(param_bytes_job, cfg=cfg.to_dict(), dtype=dtype, tp=tp)
    real = {b for b in out.values() if b is not None}
    assert real == {shard_bytes(cfg, tp, getattr(torch, dtype))}


def test_weights_that_do_not_fit_are_refused_before_any_rank_starts(tmp_path):
    r = run_cli("capture", "--model", "deepseek-v3", "--tp", "2", "--out", tmp_path / "c.safetensors")
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "deepseek-v3 needs 2.69 TB of float32 weights at TP=2 (2 ranks x 1.34 TB)" in lines[0]
    assert "available memory on this machine" in lines[0] and "--force" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_moe_layer_count_matches_the_per_layer_rule():
    """Counted without a loop (a mistyped num_hidden_layers=10**9 must be refused at once), and
    the per-rank estimate equals a whole meta-device model's parameters."""
    import itertools

    from tpsim.model import DeepseekForCausalLM
    from tpsim.parallel import TPGroup
    base = load_config(ROOT / "configs/tiny.yaml")
    for L, first, freq in itertools.product(range(1, 9), range(0, 9), range(1, 4)):
        cfg = with_overrides(base, [f"num_hidden_layers={L}", f"first_k_dense_replace={first}", f"moe_layer_freq={freq}"])
        assert cfg.moe_layer_count() == sum(cfg.is_moe_layer(k) for k in range(L))
        meta = DeepseekForCausalLM(cfg, TPGroup(size=2, device=torch.device("meta")), torch.float32)
        assert shard_bytes(cfg, 2, torch.float32) == sum(p.numel() * 4 for p in meta.parameters())
