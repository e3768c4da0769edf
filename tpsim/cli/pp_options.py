"""`--pp` and its options: a pipeline-parallel world of pp stages x tp ranks, the layers split as the
engine replayed splits them, the capture handled as that engine does at a stage boundary."""

from __future__ import annotations

import argparse

from tpsim.capture.pipeline import PP_CAPTURES
from tpsim.base.errors import UsageError
from tpsim.parallel.torchrun import under_torchrun
from tpsim.parallel.pipeline import SPLITS
from tpsim.run.pipeline import Pipeline
from tpsim.app.preflight import max_cpu_ranks, torchrun_world


def add_pp_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", help="pipeline-parallel stages (SGLang --pp-size, vLLM --pipeline-parallel-size): "
                                "pp x tp ranks, stage s on ranks s*tp..s*tp+tp-1 (default 1; --mode tp only)")
    p.add_argument("--pp-split", metavar="{" + ",".join(SPLITS) + "}",
                   help="whose get_pp_indices splits the layers (default: the --server engine's, else sglang)")
    p.add_argument("--pp-capture", metavar="{" + ",".join(PP_CAPTURES) + "}",
                   help="what a stage other than the last does with its aux hidden states: handoff (sent to the last "
                        "stage; default) or last-stage (dropped: the early return of SGLang and of vLLM before "
                        "PR #50514); with --server the profile decides")


def add_pp_served(p: argparse.ArgumentParser) -> None:
    """--pp for a command that runs no pipeline: with --server, the engine's start-up answer to it."""
    p.add_argument("--pp", help="pipeline-parallel stages served (SGLang --pp-size): with --server, an engine "
                                "that refuses them at start-up is replayed as that refusal; tpsim check --pp runs "
                                "the stages")


def pp_degree(args) -> int:
    text = getattr(args, "pp", None)
    if text is None:
        return 1
    try:
        pp = int(text)
    except ValueError:
        raise UsageError(f"--pp {text!r} is not an integer, e.g. --pp 2") from None
    if pp < 1:
        raise UsageError(f"--pp {pp} must be at least 1 (1: no pipeline parallelism)")
    return pp


def pp_tp_degrees(args, pp: int) -> list[int] | None:
    """The TP degrees of a --pp run without --tp (None: --tp was given): under torchrun the world
    size over pp, else those of 1, 2, 4, 8 whose pp x tp ranks the guard allows (at least 1)."""
    if args.tp is not None or pp == 1:
        return None
    if under_torchrun():
        world = torchrun_world()
        if world % pp:
            raise UsageError(f"--pp {pp}: the torchrun world of {world} ranks does not split into {pp} stages; "
                             f"launch pp x tp ranks")
        return [world // pp]
    return [t for t in (1, 2, 4, 8) if pp * t <= max_cpu_ranks()] or [1]


def stage_rows(pipe: Pipeline, num_layers: int, tp: int, tokens: int, hidden: int) -> list[dict]:
    """One row per stage for `explain --pp`: its layers and ranks, what it holds, what it receives and sends."""
    out = []
    for st in pipe.stages(num_layers, tp):
        holds = (["embedding"] if st.first else []) + [f"layers {st.start}..{st.end - 1}"] + \
            (["final norm", "lm_head"] if st.last else [])
        out.append({"stage": st.index, "layers": [st.start, st.end - 1], "ranks": list(st.ranks), "holds": holds,
                    "recv": [] if st.first else [f"hidden_states [{tokens}, {hidden}] from rank {r - tp}"
                                                 for r in st.ranks] + ["residual, the same"],
                    "send": [] if st.last else [f"hidden_states [{tokens}, {hidden}] to rank {r + tp}"
                                                for r in st.ranks] + ["residual, the same"]})
    return out
