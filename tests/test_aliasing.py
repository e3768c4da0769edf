"""In-place aliasing: the engines' fused add-RMSNorm writes the sum into the residual's storage,
so a capture that keeps a reference to the residual (no clone) ends up holding whatever the last
in-place add left there. On real gloo ranks, for drawn configs x tp x modes x token counts x
captured positions:

- updating the residual in place computes the same model (logits bitwise equal to the
  out-of-place run);
- the cloned in-layer capture holds the positions asked for (equal to the between-layers one);
- every uncloned slot before the last boundary is reported modified after capture, now holding
  out(L-1) (all of them the same buffer's final state), and `check` fails naming the aliasing;
  the clone passes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import run_cli
from strategies import forward_cases
from test_properties import TINY
from tpsim.capture import Position, PositionKind
from tpsim.config.loader import config_from_dict
from tpsim.modes import ArFusion, TensorParallel
from tpsim.parallel import TPGroup
from tpsim.run.jobs import build_model, rel_err, run_captured_parts
from tpsim.testing.jobs import aliasing_job

TOL = 1e-5


@st.composite
def aliasing_cases(draw):
    tp, cfg, positions, seed, ids = draw(forward_cases())
    T = len(ids)
    mode = draw(st.sampled_from([TensorParallel(), ArFusion(T), ArFusion()]), label="mode")
    return mode, tp, cfg, positions, seed, ids


@settings(max_examples=max(6, settings.default.max_examples // 10))
@example(c=(TensorParallel(), 2, TINY, [Position(PositionKind.EMBED), Position(PositionKind.OUT, 3), Position(PositionKind.OUT, 7)], 0, list(range(8))))
@example(c=(ArFusion(), 4, TINY, [Position(PositionKind.OUT, 1), Position(PositionKind.OUT, 4)], 1, list(range(5))))
@given(c=aliasing_cases())
def test_an_uncloned_capture_holds_the_last_residual_and_is_reported(rank_pool, c):
    mode, tp, cfg_d, positions, seed, ids = c
    cfg = config_from_dict(cfg_d)
    L = cfg.num_hidden_layers
    out = rank_pool.run(aliasing_job, cfg=cfg_d, seed=seed, input_ids=ids, positions=[str(p) for p in positions],
                        tp=tp, mode=mode.to_dict())
    last = Position.at_boundary(L)
    *truth, truth_last = run_captured_parts(build_model(cfg, TPGroup(), seed, "float32"), ids, [*positions, last])[0]
    for r in range(tp):
        got = out[r]
        in_place, out_of_place = got["logits"]
        assert torch.equal(in_place, out_of_place), "the in-place residual changed the model"
        for p, cloned, ref in zip(positions, got["cloned"], truth):
            assert rel_err(cloned, ref) <= TOL, f"the cloned in-layer capture of {p} is not {p}"
        want = [(str(p), str(last)) for p in positions if p.boundary < L]
        assert got["modified"] == want
        aliased = [u for p, u in zip(positions, got["uncloned"]) if p.boundary < L]
        assert all(torch.equal(a, aliased[0]) for a in aliased), "the aliased slots are not one buffer's final state"
        for p, uncloned, cloned in zip(positions, got["uncloned"], got["cloned"]):
            assert rel_err(uncloned, truth_last if p.boundary < L else cloned) <= TOL, p


def test_check_names_the_aliasing_and_the_clone_passes():
    bad = run_cli("check", "--strategy", "in-layer-uncloned", "--tp", "1,2", "--seq-len", "6", "--layers", "0,3")
    assert bad.returncode == 1, bad
    assert "out(0): modified after capture (aliasing)" in bad.stdout and "it now holds out(7), not out(0)" in bad.stdout
    assert "clone the residual when capturing" in bad.stdout
    good = run_cli("check", "--strategy", "in-layer", "--tp", "1,2", "--seq-len", "6", "--layers", "0,3")
    assert good.returncode == 0, good


@pytest.fixture(scope="module")
def every_layer(tmp_path_factory):
    """A TP=1 capture of every layer's output of tiny (the reference diagnose compares with)."""
    d = tmp_path_factory.mktemp("aliasing-diagnose")
    r = run_cli("capture", "--tp", "1", "--convention", "output-of", "--layers", ",".join(map(str, range(8))),
                "--seq-len", "6", "--out", d / "ref.safetensors")
    assert r.returncode == 0, r
    return d


@settings(max_examples=3, deadline=None)
@example(layers=[1, 3, 5], tp=2, strategy="in-layer-uncloned")
@example(layers=[2, 4], tp=1, strategy="in-layer")
@given(layers=st.lists(st.integers(0, 6), min_size=2, max_size=3, unique=True).map(sorted),
       tp=st.sampled_from([1, 2]), strategy=st.sampled_from(["in-layer-uncloned", "in-layer"]))
def test_diagnose_names_aliasing_in_a_capture_file(every_layer, layers, tp, strategy):
    """diagnose on an uncloned capture file: every slot before the last layer holds out(7) and is named
    "modified after capture (aliasing)"; the cloned capture is right and names nothing."""
    out = every_layer / f"{strategy}-{tp}-{'-'.join(map(str, layers))}.safetensors"
    r = run_cli("capture", "--strategy", strategy, "--tp", str(tp), "--convention", "output-of",
                "--layers", ",".join(map(str, layers)), "--seq-len", "6", "--out", out, "--force")
    assert r.returncode == 0, r
    d = run_cli("diagnose", out, "--reference", every_layer / "ref.safetensors")
    if strategy == "in-layer":
        assert d.returncode == 0 and "modified after capture" not in d.stdout, d
        return
    assert d.returncode == 1, d
    for k in layers:
        assert f"this is out(7), you asked for out({k}); modified after capture (aliasing): {len(layers)} slots" \
            in d.stdout, d.stdout
