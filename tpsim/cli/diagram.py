"""The `tpsim explain` diagram: one lane (a column) per rank, the run's points and collectives
top to bottom in the order they ran. Each point is drawn in each lane as that rank's piece of
the full tensor (the dashed outline), to scale; each collective as arrows across the lanes."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from itertools import accumulate

from tpsim.parallel.placement import P, R, S0, S1

PLACEMENT_COLOURS = {R: "#d8f0d8", S1: "#d8e4f8", P: "#fde3c8", S0: "#efe0f7"}
LANE_BG = "#eef1f6"
ARROW, CAPTURE = "#c0392b", "#6a1b9a"
NAME_W, LANE_W, GUTTER, PAD = 330, 136, 8, 8  # PAD: between a lane's edge and the full tensor's outline
ROW_H, BOX_H, COLL_H, TOP = 34, 24, 32, 80
# resvg maps the generic "monospace" to Courier New, absent on most Linux machines, and then draws
# no text at all: name the usual monospace fonts first
FONTS = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"
CHAR_W = 6.7  # advance of an 11 px monospace glyph: sizes the text columns to their longest line


@dataclass(frozen=True)
class Step:
    """One row of the run as every rank saw it: a named point, or a collective between points."""

    kind: str  # "point" | "collective"
    name: str
    placement: str  # the point's placement, or the collective's result placement
    detail: str  # a collective's bytes per rank
    capture: str  # a point's capture ids per convention ("" when none captures it)
    shapes: tuple[tuple[int, ...], ...]  # per rank, in rank order


def pieces(step: Step) -> list[tuple[float, float]]:
    """(start, width) of each rank's piece as a share of the full tensor. A shard's share is its
    size over all ranks' sizes, not 1/tp: dp-attention splits tokens unevenly."""
    dim = {S1: -1, S0: 0}.get(step.placement)
    if dim is None:
        return [(0.0, 1.0)] * len(step.shapes)
    sizes = [s[dim] for s in step.shapes]
    total = sum(sizes) or 1
    return [(a / total, n / total) for a, n in zip(accumulate([0, *sizes]), sizes)]


def _text(x, y, s, size=11, fill="#222", extra="") -> str:
    return f'<text x="{x}" y="{y}" font-size="{size}" fill="{fill}" {extra}>{escape(s)}</text>'


def _diamond(cx, cy) -> str:
    return f'<path d="M{cx},{cy - 5} l5,5 l-5,5 l-5,-5 z" fill="{CAPTURE}" stroke="#fff"/>'


def draw(steps: list[Step], title: str) -> str:
    tp = len(steps[0].shapes)
    lanes = [NAME_W + r * (LANE_W + GUTTER) for r in range(tp)]
    cap_x = lanes[-1] + LANE_W + 16
    y, body = TOP, []
    for s in steps:
        if s.kind == "collective":
            body += _collective(s, y, [x + LANE_W / 2 for x in lanes], cap_x)
            y += COLL_H
        else:
            body += _point(s, y, lanes, cap_x)
            y += ROW_H
    lane_bands = "".join(f'<rect x="{x}" y="{TOP - 30}" width="{LANE_W}" height="{y - TOP + 40}" rx="6" '
                         f'fill="{LANE_BG}"/>' + _text(x + LANE_W / 2, TOP - 12, f"rank {r}", 12,
                                                      extra='text-anchor="middle" font-weight="bold"')
                         for r, x in enumerate(lanes))
    headers = (_text(10, TOP - 12, "point / collective", 12, "#666")
               + _text(cap_x, TOP - 12, "captured by (id per convention) / bytes moved", 12, "#666"))
    y += 40
    legend = _legend(y)
    longest = max([len(s.capture) + 2 for s in steps] + [len(s.detail) for s in steps] + [46])
    width = max(cap_x + CHAR_W * longest + 20, 10 + 8.4 * len(title), 850)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y + 60}" '
            f'font-family="{FONTS}"><defs>'
            '<marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto" '
            f'markerUnits="userSpaceOnUse"><path d="M0,0 L8,4 L0,8 z" fill="{ARROW}"/></marker>'
            '<pattern id="summand" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#c98a4b" '
            'stroke-width="1.5"/></pattern></defs>'
            '<rect width="100%" height="100%" fill="#fff"/>'
            + _text(10, 26, title, 14, extra='font-weight="bold"') + headers + lane_bands
            + "".join(body) + "".join(legend) + "</svg>\n")


def _collective(s: Step, y: float, centres: list[float], cap_x: float) -> list[str]:
    """A collective at height y: its name, a bar across the lanes and an arrow down each, its bytes."""
    mid, top, bottom = y + COLL_H / 2, y - (ROW_H - BOX_H) / 2, y + COLL_H + (ROW_H - BOX_H) / 2
    return [_text(10, mid + 4, s.name, fill=ARROW),
            f'<line x1="{centres[0] - 3}" y1="{mid}" x2="{centres[-1] + 3}" y2="{mid}" '
            f'stroke="{ARROW}" stroke-width="3"/>',
            *(f'<line x1="{c}" y1="{top}" x2="{c}" y2="{mid}" stroke="{ARROW}" stroke-width="2"/>'
              f'<line x1="{c}" y1="{mid}" x2="{c}" y2="{bottom - 1}" stroke="{ARROW}" stroke-width="2" '
              'marker-end="url(#arrow)"/>' for c in centres),
            _text(cap_x, mid + 4, s.detail, fill=ARROW)]


def _point(s: Step, y: float, lanes: list[float], cap_x: float) -> list[str]:
    """A point at height y: its name and placement, each rank's piece in its lane, its capture ids."""
    slot, top = LANE_W - 2 * PAD, y + (ROW_H - BOX_H) / 2
    body = [_text(10, y + 15, s.name, 12, extra='font-weight="bold"'), _text(10, y + 28, s.placement, 10, "#666")]
    colour = PLACEMENT_COLOURS.get(s.placement, "#eeeeee")
    for r, (x, (start, share), shape) in enumerate(zip(lanes, pieces(s), s.shapes)):
        x0, shape_text = x + PAD, "x".join(map(str, shape))
        geometry = f'x="{x0 + start * slot:.2f}" y="{top}" width="{share * slot:.2f}" height="{BOX_H}"'
        body.append(f'<rect x="{x0}" y="{top}" width="{slot}" height="{BOX_H}" fill="none" stroke="#888" '
                    f'stroke-dasharray="3,3"/><rect class="shard" data-rank="{r}" data-placement="{s.placement}" '
                    f'{geometry} fill="{colour}" stroke="#555"><title>{escape(s.name)} on rank {r}: '
                    f'{shape_text}, {s.placement}</title></rect>')
        if s.placement == P:
            body.append(f'<rect {geometry} fill="url(#summand)"/>')
        body.append(_text(x0 + slot / 2, top + 16, shape_text, extra='text-anchor="middle"'))
        if s.capture:
            body.append(_diamond(x0 + slot, top + BOX_H / 2 - 5))
    if s.capture:
        body.append(_diamond(cap_x + 5, y + ROW_H / 2 - 5) + _text(cap_x + 14, y + ROW_H / 2 + 4, s.capture,
                                                                   fill=CAPTURE))
    return body


def _legend(y: float) -> list[str]:
    """The placements' colours, the full tensor's outline, the capture mark and the arrow, at height y."""
    legend, x = [], 10
    for p, c in PLACEMENT_COLOURS.items():
        hatch = f'<rect x="{x}" y="{y}" width="28" height="14" fill="url(#summand)"/>' if p == P else ""
        legend.append(f'<rect x="{x}" y="{y}" width="28" height="14" fill="{c}" stroke="#555"/>{hatch}'
                      + _text(x + 34, y + 11, f"{p}{' (a summand)' if p == P else ''}"))
        x += 34 + CHAR_W * len(p) + (90 if p == P else 24)
    legend.append(f'<rect x="10" y="{y + 24}" width="28" height="14" fill="none" stroke="#888" stroke-dasharray="3,3"/>'
                  + _text(44, y + 35, "the full tensor; the filled part is the rank's piece, to scale")
                  + _diamond(510, y + 26) + _text(522, y + 35, "captured", fill=CAPTURE)
                  + f'<line x1="600" y1="{y + 31}" x2="640" y2="{y + 31}" stroke="{ARROW}" stroke-width="2" '
                    'marker-end="url(#arrow)"/>' + _text(648, y + 35, "collective across the ranks", fill=ARROW))
    return legend
