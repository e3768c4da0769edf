"""`--cuda-graph` and its options: which capture set the engine's CUDA graphs freeze (its start-up
order, tpsim.run.graphs), and the graphed batch size."""

from __future__ import annotations

import argparse

from tpsim.config.loader import ModelConfig
from tpsim.base.errors import UsageError
from tpsim.modes import Mode
from tpsim.profiles.profile import GraphIds
from tpsim.profiles.registry import lookup
from tpsim.profiles.replay import replay
from tpsim.run.graphs import CudaGraphs

GRAPH_IDS = {g.name.lower(): g for g in GraphIds}
DEFAULT_GRAPH_TOKENS = 4  # a decode batch: SGLang graphs batch sizes up to --cuda-graph-max-bs


def add_graph_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda-graph", action="store_true",
                   help="also run a CUDA-graphed batch: its graph freezes the capture set of the engine's start-up "
                        "order (--server's profile, else --graph-ids); CPU: a recorded replay")
    p.add_argument("--graph-ids", metavar="{" + ",".join(GRAPH_IDS) + "}",
                   help="with --cuda-graph and no --server: what the graphs capture: config (the capture set is "
                        "set before graph capture; default), default (SGLang before PR #22836: the default ids), "
                        "none (set after graph capture: nothing)")
    p.add_argument("--graph-tokens", help=f"with --cuda-graph: the graphed batch size in tokens (default "
                                          f"{DEFAULT_GRAPH_TOKENS}); the eager batch is all the tokens run")


def graphs_from(args, cfg: ModelConfig, mode: Mode, tokens: int, pp: int) -> CudaGraphs | None:
    """The CudaGraphs the options name (None without --cuda-graph), checked against the run."""
    ids, size, server = getattr(args, "graph_ids", None), getattr(args, "graph_tokens", None), \
        getattr(args, "server", None)
    if not getattr(args, "cuda_graph", False):
        for option, value in (("--graph-ids", ids), ("--graph-tokens", size)):
            if value is not None:
                raise UsageError(f"{option} applies with --cuda-graph; add --cuda-graph or drop {option}")
        return None
    if pp > 1 or mode.rank_local or mode.context_parallel or mode.tbo:
        what = f"--pp {pp}" if pp > 1 else "--tbo" if mode.tbo else f"--mode {mode.name}"
        raise UsageError(f"--cuda-graph runs without {what} (a graphed batch of every rank's tokens); drop one of them")
    n = DEFAULT_GRAPH_TOKENS if size is None else _int(size)
    if not 1 <= n < tokens:
        raise UsageError(f"--graph-tokens {n} must be at least 1 and fewer than the {tokens} tokens run (the eager "
                         f"batch); pass --seq-len {n + 1} or more, or a smaller --graph-tokens")
    L = cfg.num_hidden_layers
    if server is None:
        if ids is not None and ids not in GRAPH_IDS:
            raise UsageError(f"unknown --graph-ids {ids!r}; use one of {', '.join(GRAPH_IDS)}")
        order = GRAPH_IDS[ids or "config"]
        engine = lookup("sglang", cfg.model_type)  # whose default ids a DEFAULT order captures
        return CudaGraphs(order, n, tuple(replay(engine, None, L).positions),
                          f"--graph-ids {ids or 'config'}: {order.value} (default ids: {engine.name}'s)")
    if ids is not None:
        raise UsageError(f"--server {server} decides what its graphs capture (its start-up order); drop --graph-ids")
    profile = lookup(server, cfg.model_type)
    g = profile.behaviour.graphs
    if g is None:
        raise UsageError(f"--server {server}: {profile.name} has no CUDA-graph path (a trainer); drop --cuda-graph")
    return CudaGraphs(g.value, n, tuple(replay(profile, None, L).positions),
                      f"{profile.name}: {g.value.value} ({g.source})")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--graph-tokens {text!r} is not an integer, e.g. --graph-tokens 4") from None
