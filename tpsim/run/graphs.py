"""`check --cuda-graph`: an engine's start-up order decides which capture set its CUDA graphs freeze.

SGLang's `ModelRunner.initialize` (PR #22836, merged 2026-04-15, first in 0.5.11): before the PR
`set_eagle3_layers_to_capture()` ran after the graphs were captured, so graphed batches ran without
capture (zero acceptance); `CudaGraphRunner` worked around it by calling the setter with no ids
before capturing, so graphed batches captured the default ids and eager ones the config's. The
PR moves `init_aux_hidden_state_capture()` before `init_device_graphs()`. Which releases ran
without the workaround is not known (the PR describes the workaround as present), so the profiles
say DEFAULT before 0.5.11 and CONFIG from it; `--graph-ids none` replays the order without it.

The job (tpsim.run.graph_jobs) starts the "server" in that order on real ranks, captures one graph
per `--graph-tokens` batch size (CUDA: real graphs; CPU: recorded replays, tpsim.capture.graphs),
then runs a graphed batch and an eager one, and compares the graphed batch's capture with TP=1's
capture of the configured positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpsim.capture import Position
from tpsim.capture.graphs import GraphRunner
from tpsim.profiles.profile import GraphIds


@dataclass(frozen=True)
class CudaGraphs:
    """`--cuda-graph`: the start-up order (`ids`: which ids the graphs end up with), the graphed batch
    size, the engine's default positions, and where the order comes from (a profile's source, or
    the option)."""

    ids: GraphIds
    tokens: int
    default: tuple[Position, ...]
    why: str

    def to_dict(self) -> dict:
        return {"graph_ids": self.ids.name.lower(), "graph_tokens": self.tokens,
                "default": [str(p) for p in self.default], "why": self.why}


def start(order: GraphIds, runner: GraphRunner, config: list[Position], default: list[Position]) -> None:
    """The engine's start-up, as far as capture cares: set the capture set and capture the graphs in
    the order `order` stands for (the module docstring)."""
    capture_set = runner.capture_set
    if order is GraphIds.CONFIG:  # init_aux_hidden_state_capture() before init_device_graphs()
        capture_set.set(config)
        runner.capture()
    elif order is GraphIds.DEFAULT:  # CudaGraphRunner's workaround: set_eagle3_layers_to_capture() with no ids
        capture_set.set(default)
        runner.capture()
        capture_set.set(config)
    else:  # set_eagle3_layers_to_capture(config ids) after the graphs were captured
        runner.capture()
        capture_set.set(config)


@dataclass(frozen=True)
class GraphCheck:
    """At one TP degree (group rank 0): what a graphed and an eager batch captured, and the graphed
    capture against TP=1's capture of the configured positions on the same tokens."""

    tp: int
    graphed_tokens: int
    eager_tokens: int
    graphed: list[str]
    eager: list[str]
    configured: list[str]
    rel_err: float | None  # graphed vs TP=1 (None: the positions differ, nothing to compare)
    identical: bool        # the graphed capture is bitwise the same on every rank of the group

