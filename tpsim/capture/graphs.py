"""CUDA graphs freeze the capture set: a graph records the forward as it ran when it was captured,
so the positions a graphed batch captures are the ones set at that moment, whatever is set later
(SGLang's graph runner captures one graph per batch size at start-up; later changes reach only the
batches that run eagerly).

`CaptureSet` is the engine's live capture set (`layers_to_capture`). `GraphRunner` captures a graph
per batch size, of the type it is given: on CUDA a real `GraphedForward`, on CPU a
`RecordedGraph` (a CPU forward cannot be recorded, so it replays the forward with the positions
snapshotted at capture), and runs a batch: a graphed size replays its graph, any other runs eagerly
with the set as it is now.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpsim.capture.positions import Position
from tpsim.capture.recorder import Recorder
from tpsim.modes.strategy import Strategy


@dataclass
class CaptureSet:
    """The positions the engine's capture loop tests now (SGLang's `layers_to_capture`)."""

    positions: list[Position] = field(default_factory=list)

    def set(self, positions: list[Position]) -> None:
        self.positions = list(positions)


def captured(model, ids: torch.Tensor, positions: list[Position], strategy: Strategy):
    """One forward with `positions` captured: (capture `[T, n * hidden]`, `[T, 0]` when nothing is
    captured; logits)."""
    recorder = Recorder(positions, strategy)
    with model.probe.attach(recorder):
        logits = model(ids)
    return (recorder.concat() if positions else logits.new_zeros((ids.shape[0], 0))), logits


class RecordedGraph:
    """A graph of `num_tokens` tokens on CPU: the capture positions snapshotted when it is made."""

    def __init__(self, model, num_tokens: int, positions: list[Position], strategy: Strategy = Strategy.MODEL_LEVEL):
        self.model, self.num_tokens, self.positions, self.strategy = model, num_tokens, list(positions), strategy

    def __call__(self, ids: torch.Tensor):
        return captured(self.model, ids, self.positions, self.strategy)


class GraphedForward:
    """`model` (TP=1, or NCCL groups: gloo collectives cannot be captured) forward of `num_tokens`
    tokens with capture of `positions`, as a real CUDA graph: at decode and target-verify sizes a
    forward is bound by kernel launches and Python; it has no host sync (tests/test_gpu.py checks).

    `g(ids)` copies ids `[num_tokens]` (int64, on the model's GPU) into the graph's input and
    replays it; it returns (capture `[T, len(positions) * hidden]`, logits `[T, vocab]`), tensors
    owned by the graph and overwritten by the next replay (clone to keep them).
    """

    def __init__(self, model, num_tokens: int, positions: list[Position], strategy: Strategy = Strategy.MODEL_LEVEL,
                 warmup: int = 3):
        device = model.group.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if model.group.size > 1 and model.group.pg is not None and \
                torch.distributed.get_backend(model.group.pg) != "nccl":
            raise ValueError("a graph cannot capture gloo collectives: use TP=1 or NCCL")
        self.model, self.positions, self.strategy = model, list(positions), strategy
        self.ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph requires
            for _ in range(warmup):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.capture, self.logits = self._forward()

    def _forward(self):
        return captured(self.model, self.ids, self.positions, self.strategy)

    def __call__(self, ids: torch.Tensor):
        self.ids.copy_(ids)
        self.graph.replay()
        return self.capture, self.logits


@dataclass(frozen=True)
class Ran:
    """One batch through the runner: graphed or eager, the positions it captured, the capture, logits."""

    graphed: bool
    positions: tuple[Position, ...]
    capture: torch.Tensor
    logits: torch.Tensor


class GraphRunner:
    """Graphs for the batch sizes `sizes` of `model`, capturing what `capture_set` holds when
    `capture()` runs; `run(ids)` replays the graph of that size, or runs eagerly."""

    def __init__(self, model, capture_set: CaptureSet, sizes: list[int], strategy: Strategy = Strategy.MODEL_LEVEL,
                 graph: type = RecordedGraph):
        self.model, self.capture_set, self.sizes, self.strategy = model, capture_set, sorted(sizes), strategy
        self.graph_type, self.graphs = graph, {}

    def capture(self) -> None:
        """One graph per size, each with the capture set as it is now."""
        frozen = list(self.capture_set.positions)
        for n in self.sizes:
            self.graphs[n] = self.graph_type(self.model, n, frozen, self.strategy)

    def run(self, ids: torch.Tensor) -> Ran:
        graph = self.graphs.get(ids.shape[0])
        if graph is not None:
            capture, logits = graph(ids)
            return Ran(True, tuple(graph.positions), capture.clone(), logits.clone())
        positions = tuple(self.capture_set.positions)
        capture, logits = captured(self.model, ids, list(positions), self.strategy)
        return Ran(False, positions, capture, logits)
