"""`tpsim acceptance` on CUDA: the draft's chains on the GPU are the CPU's (float32, TF32 off), and the command
runs a seeded target and draft on the device, the same capture giving the same acceptance."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from clirun import run_cli
from test_acceptance_cli import tiny_draft
from test_acceptance_core import seeded_draft
from tpsim.draft.acceptance import chains

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run pytest -m gpu on a GPU node")]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(3, 40), k=st.integers(1, 4))
def test_chains_on_the_gpu_are_the_cpus(seed, length, k):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(seed + 1)
    capture, tokens = torch.randn(length, 48, generator=g), torch.randint(0, 40, (length,), generator=g)
    gpu = seeded_draft(seed, device="cuda")
    want = chains(seeded_draft(seed), capture, tokens, k)
    assert torch.equal(chains(gpu, capture.cuda(), tokens.cuda(), k).cpu(), want)


def test_the_command_on_cuda(tmp_path):
    path = tiny_draft(tmp_path / "d", [1, 3, 4])
    r = run_cli("acceptance", "--device", "cuda", "--dtype", "float32", "--draft", str(path), "--server",
                "sglang@0.5.12", "--new-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["trained"]["rounds"] == out["served"]["rounds"] > 0
    assert out["trained"]["acceptance_length"] == out["served"]["acceptance_length"]
