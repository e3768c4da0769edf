"""Named capture points and `tpsim explain`, on real gloo ranks.

For every drawn config and TP degree: the points the layers report in a real run are exactly
the static catalogue (names, order, placements), and each point's per-rank tensors really are
what its placement says about the TP=1 tensor (Replicate(): each rank holds it; Shard(dim=-1):
the ranks' concatenation along the last dim is it; Partial(sum): the ranks' sum is it), and
`tpsim diagnose` recovers that placement from the rank tensors alone."""

from __future__ import annotations

import json
import xml.dom.minidom
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from strategies import TP_DEGREES, config_dicts
from clirun import run_cli
from tpsim.capture.points import catalogue
from tpsim.parallel.placement import P, R, S1
from tpsim.config.loader import config_from_dict
from tpsim.offline.diagnosis import diagnose_tensors
from tpsim.run.jobs import rel_err
from tpsim.run.jobs import points_job
from tpsim.run.spec import ModelSource, RunSpec

TOL = 1e-5  # float32, as the main property


def run_points(rank_pool, cfg, tp, ids, seed=0):
    names = [n for n, _, _ in catalogue(cfg)]
    spec = RunSpec(ModelSource("drawn", cfg), seed, "float32", tuple(ids))
    out = rank_pool.run(points_job, spec=spec, tp=tp, points=names)
    return [vars(r) for r in sorted((r for r in out.values() if r is not None), key=lambda r: r.rank)]


def combine(placement: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor a placement says the ranks' local tensors make up."""
    if placement == R:
        return tensors[0]
    if placement == S1:
        return torch.cat(tensors, dim=-1)
    assert placement == P, placement
    return torch.stack([t.double() for t in tensors]).sum(0).to(tensors[0].dtype)


@settings(max_examples=20)
@given(tp=st.sampled_from(TP_DEGREES[1:]), data=st.data(), seed=st.integers(0, 2**31 - 1),
       T=st.integers(1, 12))
def test_every_point_is_what_its_placement_says(rank_pool, tp, data, seed, T):
    check_points(rank_pool, config_from_dict(data.draw(config_dicts(tp), label="config")), tp, seed, T)


def test_points_of_one_token_over_a_replicated_kv_head(rank_pool):
    """Found in CI: Llama, 2 query heads over 1 KV head at TP 2, one token: both ranks' attention
    outputs are that KV head's value row, equal and still Shard(dim=-1)."""
    cfg = config_from_dict({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "vocab_size": 2, "intermediate_size": 16, "num_key_value_heads": 1, "head_dim": 4,
                            "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False})
    check_points(rank_pool, cfg, 2, 0, 1)


def check_points(rank_pool, cfg, tp: int, seed: int, T: int) -> None:
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = run_points(rank_pool, cfg, 1, ids, seed)[0]["taps"]
    ranks = run_points(rank_pool, cfg, tp, ids, seed)
    assert len(ranks) == tp
    cat = catalogue(cfg)
    for r in ranks:
        assert [(n, t.placement) for n, t in r["taps"].items()] == [(n, p) for n, p, _ in cat]
    assert all(t.placement == R for t in ref.values())  # TP=1: every point is whole
    for name, placement, _ in cat:
        local = [r["taps"][name].tensor for r in ranks]
        if placement == R:
            assert all(torch.equal(x, local[0]) for x in local), f"{name}: Replicate() ranks differ"
        elif not (name.endswith("attn.out") and T == 1 and not cfg.mla and cfg.kv_heads < tp):
            # (one token: each head's output is its KV head's value row, the same on ranks sharing a replicated KV head)
            assert not all(torch.equal(x, local[0]) for x in local) or ref[name].tensor.abs().max() == 0, name
        full = combine(placement, local)
        assert full.shape == ref[name].tensor.shape, (name, full.shape, ref[name].tensor.shape)
        err = rel_err(full, ref[name].tensor)
        assert err <= TOL, f"TP={tp} {name} ({placement}): rel err {err:.2e} against TP=1"
        verdict = diagnose_tensors(local, {name: ref[name].tensor}, name)  # diagnose recovers the placement
        assert (verdict.placement, verdict.matches) == (placement, name), (name, verdict)


def test_capture_points_writes_one_file_per_rank(tmp_path):
    out = tmp_path / "pts.safetensors"
    points = "layers.1.attn.o_proj.partial,layers.1.mlp.in,layers.2.out,logits.local"
    r = run_cli("capture", "--tp", "4", "--points", points, "--tokens", "5,6,7", "--out", out)
    assert r.returncode == 0, r
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"pts.rank{i}.safetensors" for i in range(4)]
    parts = {}
    for i in range(4):
        with safe_open(str(tmp_path / f"pts.rank{i}.safetensors"), "pt") as f:
            meta = f.metadata()
            assert meta["format"] == "tpsim-rank-dump" and meta["rank"] == str(i) and meta["tp"] == "4"
            assert meta["points"] == points
            assert meta["placement.layers.1.attn.o_proj.partial"] == "Partial(sum)"
            assert meta["placement.logits.local"] == "Shard(dim=-1)"
            assert meta["position.layers.2.out"] == "out(2)"
            assert f.get_tensor("input_ids").tolist() == [5, 6, 7]
            parts[i] = {k: f.get_tensor(k) for k in points.split(",")}
    assert parts[0]["logits.local"].shape == (3, 1024 // 4)
    assert torch.equal(parts[0]["layers.1.mlp.in"], parts[3]["layers.1.mlp.in"])
    assert not torch.equal(parts[0]["layers.1.attn.o_proj.partial"], parts[1]["layers.1.attn.o_proj.partial"])


def test_explain_tiny_lists_every_point_and_collective(tmp_path):
    svg = tmp_path / "e.svg"
    r = run_cli("explain", "--tp", "2", "--layer", "1", "--seq-len", "5", "--json", "--svg", svg)
    assert r.returncode == 0, r
    rep = json.loads(r.stdout)
    names = [row["name"] for row in rep["rows"] if row["kind"] == "point"]
    cfg = config_from_dict({**__import__("yaml").safe_load((Path(__file__).parents[1] / "configs/tiny.yaml")
                                                           .read_text()), "num_hidden_layers": 2})
    layer1 = [n for n, _, _ in catalogue(cfg) if n.startswith("layers.1.")]
    assert names == ["embed.partial", "embed.out", "layers.0.out", *layer1, "final", "logits.local", "logits"]
    colls = [row for row in rep["rows"] if row["kind"] == "collective"]
    assert [c["name"].split()[0] for c in colls] == ["all_reduce"] * 3 + ["all_gather"]
    assert all(c["detail"].startswith("640 B per rank") for c in colls[:3])  # 5 tokens x 64 x bf16
    out1 = next(row for row in rep["rows"] if row["name"] == "layers.1.out")
    assert "sglang-ids 1" in out1["capture"] and "vllm-ids 2" in out1["capture"] and "specforge-ids 1" in out1["capture"]
    xml.dom.minidom.parse(str(svg))  # a well-formed SVG


@pytest.mark.parametrize("mode", ["tp", "ar-fusion", "sp", "ep", "dp-attention"])
def test_explain_describes_the_collectives_each_mode_ran(mode):
    """The point descriptions follow the run, not pure TP: a description names only reductions
    that ran in that mode, "before" only a partial sum, a rank's heads only a head shard."""
    r = run_cli("explain", "--mode", mode, "--tp", "2", "--seq-len", "6", "--json")
    assert r.returncode == 0, r
    rows = json.loads(r.stdout)["rows"]
    ran = {row["name"].split()[0] for row in rows if row["kind"] == "collective"}
    points = [row for row in rows if row["kind"] == "point"]
    for row in points:
        d = row["detail"]
        for op, word in (("all_reduce", "all-reduce"), ("reduce_scatter", "reduce-scatter"),
                         ("all_to_all", "all-to-all")):
            assert word not in d or op in ran, (mode, row)
        assert (" before " not in d) or row["placement"] == P, (mode, row)
        assert ("this rank's heads" not in d) or row["placement"] == S1, (mode, row)
        if row["name"].endswith(".partial") and row["placement"] != P:
            assert "nothing to reduce" in d, (mode, row)
    out1 = next(row for row in points if row["name"] == "layers.1.out")
    assert ("deferred" in out1["detail"]) == (mode == "ar-fusion") == (out1["placement"] == P), out1


def test_explain_v3_shapes_at_tp8():
    """V3's first MoE layer at TP=8 on a laptop: uninitialised weights, real shapes and bytes."""
    r = run_cli("explain", "--model", "deepseek-v3", "--tp", "8", "--seq-len", "4", "--json")
    assert r.returncode == 0, r
    rep = json.loads(r.stdout)
    assert rep["layer"] == 3 and rep["kind"] == "MoE" and rep["same_on_every_rank"]
    shapes = {row["name"]: row["shape"] for row in rep["rows"]}
    assert shapes["layers.3.attn.q"] == "4x3072"  # 128 heads / 8 x (128 + 64)
    assert shapes["layers.3.attn.kv"] == "4x4096"  # 16 heads x (128 + 128)
    assert shapes["layers.3.attn.out"] == "4x2048"
    assert shapes["layers.3.mlp.router_logits"] == "4x256"
    assert shapes["logits.local"] == "4x16160" and shapes["logits"] == "4x129280"
    assert "57344 B" not in r.stdout and any(row["detail"].startswith("56.0 KiB per rank")  # 4 x 7168 x 2
                                             for row in rep["rows"] if row["kind"] == "collective")



@pytest.mark.parametrize("argv,expect", [
    (["capture", "--points", "layers.1.attn.oproj", "--out", "{d}/x.safetensors"], ["unknown point 'layers.1.attn.oproj'"]),
    (["capture", "--points", "layers.1.mlp.in", "--layers", "2", "--out", "{d}/x.safetensors"], ["--points and --layers"]),
    (["capture", "--points", ",", "--out", "{d}/x.safetensors"], ["--points is empty"]),
    (["capture", "--points", "layers.9.mlp.in", "--out", "{d}/x.safetensors"], ["unknown point 'layers.9.mlp.in'"]),
    (["explain", "--layer", "8"], ["--layer 8 does not exist", "0..7"]),
    (["explain", "--layer", "x"], ["--layer 'x' is not an integer"]),
    (["explain", "--tp", "3"], ["--tp 3 does not divide num_attention_heads=8"]),
    (["explain", "--svg", "{d}/no/such/e.svg"], ["does not exist"]),
], ids=["unknown-point", "points-and-layers", "empty-points", "point-past-last-layer", "layer-out-of-range",
        "layer-not-int", "tp-does-not-divide", "svg-dir-missing"])
def test_points_and_explain_bad_input(tmp_path, argv, expect):
    r = run_cli(*[a.replace("{d}", str(tmp_path)) for a in argv])
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r
    for e in expect:
        assert e in lines[0], (e, lines[0])
    assert list(tmp_path.iterdir()) == []
