"""Named capture points: each layer class declares its points, and taps them through the
model's `Probe`, to which a capture attaches its sinks.

A point is named like the module that produces it, without the `model.` prefix and with
`self_attn` shortened to `attn` (`layers.3.attn.o_proj.partial`). A layer class lists its
points once, in forward order, in `POINTS` (suffix, placement at TP>1 in pure TP, what it is);
`Tapped.tap` refuses a suffix the class does not declare, and the static catalogue
(`tpsim.capture.points.catalogue`) is read from the same declarations. At TP=1 every point is
`Replicate()`.

Besides named points the probe reports the residual stream where captures read it (`boundary`,
`in_layer`, `final`, with the `Rows` the tensor holds; `micro_batch` under two-batch overlap): what
the EAGLE-3 recorder stores.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, NamedTuple, Union

import torch

from tpsim.parallel.group import TPGroup
from tpsim.parallel.placement import R, S0, Placement

Lazy = Union[torch.Tensor, Callable[[], torch.Tensor]]  # a function making it: an unwanted point costs nothing


def point_name(prefix: str) -> str:
    """`model.layers.3.self_attn.o_proj` -> `layers.3.attn.o_proj`."""
    return prefix.removeprefix("model.").replace(".self_attn", ".attn")


def _join(base: str, suffix: str) -> str:
    return f"{base}.{suffix}" if base and suffix else base or suffix


@dataclass(frozen=True)
class Point:
    """One declared point of a layer class: `what` may name `{k}` (the decoder layer) and
    `{module}` (the last part of the producing module's name)."""

    suffix: str
    placement: Placement  # at TP>1 in pure TP
    what: str


class NamedPoint(NamedTuple):
    """A point of a model's catalogue."""

    name: str
    placement: Placement  # at TP>1 in pure TP
    what: str


@dataclass(frozen=True)
class Rows:
    """Which token rows a residual-stream tensor on this rank holds: `split` None, all the
    rank's tokens (the whole batch, or its own sequence); else this rank's `split[rank]` rows
    of the batch's Shard(dim=0) split, of which the first `real` are tokens (the rest padding)."""

    group: TPGroup
    total: int
    split: tuple[int, ...] | None = None
    real: int = 0

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's real token rows."""
        return x if self.split is None else x[:self.real]

    def gathered(self, x: torch.Tensor, caller: str) -> torch.Tensor:
        """All `total` token rows, all-gathered when split."""
        return x if self.split is None else self.group.gather_rows(x, list(self.split), caller)[:self.total]


class Sink:
    """What a capture attaches to a Probe. Every hook does nothing here; a capture overrides
    the ones it needs. `in_place`: the capture keeps references into the residual stream, so the
    model must update the residual in place as the engines' fused add-RMSNorm kernels do."""

    in_place = False
    hears_points = False  # whether `point` does anything: named points are offered only then

    def point(self, name: str, x: Lazy, placement: Placement, order: int) -> None:
        """Named point `name`; `order`: how many collectives this rank had run when it was made."""

    def boundary(self, b: int, hidden: torch.Tensor, residual: torch.Tensor | None, rows: Rows) -> None:
        """The stream entering layer b (`hidden + residual`; residual None at b=0), b=L after the last."""

    def in_layer(self, b: int, residual: torch.Tensor, rows: Rows) -> None:
        """The residual just after layer b's input-norm add (b=L: the final norm's)."""

    def final(self, normed: torch.Tensor, rows: Rows) -> None:
        """The final norm's output, before any gather."""

    def micro_batch(self, b: int, start: int, total: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Two-batch overlap: one micro-batch's stream entering layer b (b=L after the last), its rows
        the tokens start..start+len of `total`. The engine's capture loop never sees these."""


class Probe:
    """Where the layers of one model offer their activations: to every attached sink, with the
    placement at this group's size (Replicate() at size 1). `own_tokens()` is the view for layers
    that run whole on each rank's own tokens (dp-attention): all their points are Shard(dim=0)."""

    def __init__(self, group: TPGroup):
        self.size, self.tracer = group.size, group.tracer
        self.sinks: list[Sink] = []
        self.owned = False

    def own_tokens(self) -> "Probe":
        view = copy.copy(self)  # the same sinks
        view.owned = True
        return view

    def whole(self) -> "Probe":
        """The view for a layer that runs whole on every rank over all tokens (context parallelism's
        LM head): all its points Replicate()."""
        view = copy.copy(self)  # the same sinks
        view.size = 1
        return view

    @contextmanager
    def attach(self, sink: Sink) -> Iterator[Sink]:
        """`sink` hears this model's forwards inside the block."""
        self.sinks.append(sink)
        try:
            yield sink
        finally:
            # by identity: two sinks may compare equal
            del self.sinks[next(i for i, s in enumerate(self.sinks) if s is sink)]

    @property
    def in_place(self) -> bool:
        """Whether an attached capture needs the residual updated in place (tpsim.model.decoder.add_norm)."""
        return any(s.in_place for s in self.sinks)

    @property
    def listening(self) -> bool:
        """Whether an attached sink hears named points (a `tpsim capture` of points): only then do
        taps offer anything, and only then must a sublayer run eagerly (tpsim.layers.fused.region)."""
        return any(s.hears_points for s in self.sinks)

    def offer(self, name: str, x: Lazy, placement: Placement) -> None:
        where = R if self.size == 1 else S0 if self.owned else placement
        order = len(self.tracer.records)
        for s in self.sinks:
            s.point(name, x, where, order)

    def boundary(self, b: int, hidden: torch.Tensor, residual: torch.Tensor | None, rows: Rows) -> None:
        for s in self.sinks:
            s.boundary(b, hidden, residual, rows)

    def in_layer(self, b: int, residual: torch.Tensor, rows: Rows) -> None:
        for s in self.sinks:
            s.in_layer(b, residual, rows)

    def final(self, normed: torch.Tensor, rows: Rows) -> None:
        for s in self.sinks:
            s.final(normed, rows)

    def micro_batch(self, b: int, start: int, total: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        for s in self.sinks:
            s.micro_batch(b, start, total, hidden, residual)


class Tapped:
    """Mixin of a layer with named points: the class declares `POINTS`; an instance sets `point`
    (its name base) and `probe`, and taps a declared suffix with `tap`."""

    POINTS: ClassVar[tuple[Point, ...]] = ()
    _by_suffix: ClassVar[dict[str, Point]] = {}
    point: str
    probe: Probe

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._by_suffix = {p.suffix: p for p in cls.POINTS}

    def tap(self, suffix: str, x: Lazy, placement: Placement | None = None) -> None:
        """Offer point `suffix` of this layer (at its declared placement unless given)."""
        declared = self.declared_point(suffix)
        # a compiled region runs only when nobody listens (fused.region), so it traces no tap
        if not torch.compiler.is_compiling() and self.probe.listening:
            self.probe.offer(_join(self.point, suffix), x, declared.placement if placement is None else placement)

    @classmethod
    def declared_point(cls, suffix: str) -> Point:
        if suffix not in cls._by_suffix:
            raise LookupError(f"{cls.__name__} taps point {suffix!r}, which its POINTS do not declare "
                              f"(declared: {', '.join(repr(p.suffix) for p in cls.POINTS) or 'none'})")
        return cls._by_suffix[suffix]

    @classmethod
    def declared(cls, base: str, *suffixes: str, **fields) -> list[NamedPoint]:
        """(name, placement at TP>1, what) of this class's points under `base` (those `suffixes`,
        or all), in declaration order."""
        fields.setdefault("module", base.rpartition(".")[2])
        chosen = [cls.declared_point(s) for s in suffixes] if suffixes else cls.POINTS
        return [NamedPoint(_join(base, p.suffix), p.placement, p.what.format(**fields)) for p in chosen]
