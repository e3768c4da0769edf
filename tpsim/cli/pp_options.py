"""`--pp` and its options: a pipeline-parallel world of pp stages x tp ranks, the layers split as the
engine replayed splits them, the capture handled as that engine does at a stage boundary."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tpsim.base.errors import UsageError
from tpsim.cli.choices import PP_CAPTURES, SPLITS

if TYPE_CHECKING:
    from tpsim.run.pipeline import Pipeline


def add_pp_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", help="pipeline-parallel stages (SGLang --pp-size, vLLM --pipeline-parallel-size): "
                                "pp x tp ranks, stage s on ranks s*tp..s*tp+tp-1 (default 1; --mode tp only)")
    p.add_argument("--pp-split", metavar="{" + ",".join(SPLITS) + "}",
                   help="whose get_pp_indices splits the layers (default: the --server engine's, else sglang)")
    p.add_argument("--pp-capture", metavar="{" + ",".join(PP_CAPTURES) + "}",
                   help="what a stage other than the last does with its aux hidden states: handoff (sent to the last "
                        "stage; default) or last-stage (dropped: the early return of SGLang and of vLLM before "
                        "PR #50514); with --server the profile decides")


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
