"""The `tpsim explain` diagram (tpsim/cli/diagram.py): one lane per rank, found in the rendered
pixels; every rank's piece of a point drawn to scale with its share of the full tensor."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from clirun import run_cli
from tpsim.cli.diagram import LANE_BG, Step, draw
from tpsim.parallel.placement import P, R, S0, S1

# The renderer and the PNG decoder come with the `test` extra; without them (the GPU image) the module skips.
png = pytest.importorskip("png", reason="pypng is not installed: pip install -e '.[test]'")
resvg_py = pytest.importorskip("resvg_py", reason="resvg-py is not installed: pip install -e '.[test]'")

SVG_RECT = "{http://www.w3.org/2000/svg}rect"
WIDTH = 64


def point(name: str, placement: str, tokens: list[int], capture: str = "") -> Step:
    """A point as `tp = len(tokens)` ranks hold it: a Shard(dim=-1) rank holds 1/tp of the width,
    a Shard(dim=0) rank its own tokens, any other rank all of them."""
    tp, total = len(tokens), sum(tokens)
    shapes = {S1: [(total, WIDTH // tp)] * tp, S0: [(n, WIDTH) for n in tokens]}.get(placement, [(total, WIDTH)] * tp)
    return Step("point", name, placement, "", capture, tuple(shapes))


def layer(tp: int) -> list[Step]:
    """A dense layer's shape: a head shard, its partial sum, the all-reduce, a captured output."""
    even = [4] * tp
    return [point("attn.in", R, even), point("attn.q", S1, even), point("o_proj.partial", P, even),
            Step("collective", "all_reduce (o_proj)", R, "512 B per rank, bfloat16", "", ((4 * tp, WIDTH),) * tp),
            point("out", R, even, capture="out(1): sglang-ids 1 / vllm-ids 2"), point("tokens", S0, even)]


def render(svg: str) -> np.ndarray:
    """The SVG drawn by resvg, as an (height, width, RGBA) array."""
    w, h, rows, _ = png.Reader(bytes=bytes(resvg_py.svg_to_bytes(svg_string=svg))).asRGBA8()
    return np.array([list(r) for r in rows], dtype=np.uint8).reshape(h, w, 4)


def lanes_in(pixels: np.ndarray) -> int:
    """How many lanes the picture shows: bands of columns (at least 20 px wide) in which the lane
    background colour shows through between the boxes, with other colours on either side."""
    lane = np.array([int(LANE_BG[i:i + 2], 16) for i in (1, 3, 5)])
    on_lane = (np.abs(pixels[:, :, :3].astype(int) - lane) <= 2).all(axis=2).mean(axis=0) > 0.1
    edges = np.flatnonzero(np.diff(np.concatenate([[0], on_lane.astype(int), [0]])))
    return sum(1 for start, end in zip(edges[::2], edges[1::2]) if end - start >= 20)


def assert_a_real_picture(pixels: np.ndarray) -> None:
    rgb = pixels[:, :, :3].astype(int)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 400
    assert (pixels[:, :, 3] == 255).all()  # an opaque background, not a transparent canvas
    assert (rgb.min(axis=2) < 250).mean() > 0.1  # not blank
    assert (rgb.max(axis=2) < 90).sum() > 2000  # text drawn (no font: no dark pixels at all)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 20


@pytest.mark.parametrize("tp", [2, 4])
def test_one_lane_per_rank_in_the_pixels(tp):
    svg = draw(layer(tp), f"a layer at TP={tp}")
    pixels = render(svg)
    assert_a_real_picture(pixels)
    assert lanes_in(pixels) == tp
    assert all(f">rank {r}</text>" in svg for r in range(tp)) and f">rank {tp}<" not in svg


@settings(deadline=None)
@given(tp=st.integers(1, 8), placements=st.lists(st.sampled_from([R, S1, S0, P]), max_size=6),
       tokens=st.data())
def test_each_rank_piece_is_its_share_of_the_full_tensor(tp, placements, tokens):
    """Property: next to the Replicate() box, a Shard(dim=-1) piece is 1/tp of its width and
    starts at rank/tp of it, a Partial(sum) one is as wide, a Shard(dim=0) one is the rank's
    share of the tokens (uneven under dp-attention); the pieces of a shard tile the full tensor."""
    split = tokens.draw(st.lists(st.integers(1, 9), min_size=tp, max_size=tp))
    steps = [point(f"p{i}", p, split if p == S0 else [4] * tp) for i, p in enumerate([R, S1, *placements])]
    boxes = [b for b in ET.fromstring(draw(steps, "t")).iter(SVG_RECT) if b.get("class") == "shard"]
    assert len(boxes) == len(steps) * tp
    full = float(boxes[0].get("width"))
    for i, s in enumerate(steps):
        mine = boxes[i * tp:(i + 1) * tp]
        assert [b.get("data-rank") for b in mine] == [str(r) for r in range(tp)]
        assert all(b.get("data-placement") == s.placement for b in mine)
        share = [n / sum(split) for n in split] if s.placement == S0 else \
            [1 / tp] * tp if s.placement == S1 else [1.0] * tp
        widths = [float(b.get("width")) for b in mine]
        assert widths == pytest.approx([full * f for f in share], abs=0.006)
        starts = [float(b.get("x")) - float(boxes[r].get("x")) for r, b in enumerate(mine)]
        if s.placement in (S0, S1):
            assert starts == pytest.approx([full * sum(share[:r]) for r in range(tp)], abs=0.011)
        else:
            assert starts == pytest.approx([0.0] * tp, abs=0.006)


def test_explain_draws_the_tiny_layer_rank_by_rank(tmp_path):
    out = tmp_path / "explain.svg"
    r = run_cli("explain", "--model", "configs/tiny.yaml", "--tp", "2", "--svg", out)
    assert r.returncode == 0, r
    svg = out.read_text()
    pixels = render(svg)
    assert_a_real_picture(pixels)
    assert lanes_in(pixels) == 2
    boxes = [b for b in ET.fromstring(svg).iter(SVG_RECT) if b.get("class") == "shard"]
    q = [b for b in boxes if b.findtext("{http://www.w3.org/2000/svg}title").startswith("layers.1.attn.q on")]
    assert [b.findtext("{http://www.w3.org/2000/svg}title") for b in q] == \
        [f"layers.1.attn.q on rank {r}: 16x96, Shard(dim=-1)" for r in (0, 1)]
    assert ">all_reduce (model.layers.1.mlp)</text>" in svg and "2.0 KiB per rank" in svg
    assert "out(1): sglang-ids 1 / sglang-boundary-ids 2 / vllm-ids 2" in svg
