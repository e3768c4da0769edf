"""`--cuda-graph` and its options: which capture set the engine's CUDA graphs freeze (its start-up
order, tpsim.run.graphs), and the graphed batch size."""

from __future__ import annotations

import argparse

from tpsim.cli.choices import DEFAULT_GRAPH_TOKENS, GRAPH_IDS


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
