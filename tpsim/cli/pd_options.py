"""`check --disaggregate P:D` and `--draft-hidden`: SGLang's prefill/decode disaggregation, the prefill
server's TP group handing the decode server's the EAGLE-3 draft's state (no torch: --help reads this)."""

from __future__ import annotations

import argparse

from tpsim.base.errors import UsageError

# what a disaggregated check does not run: each a dimension of `check`'s own comparison
NOT_WITH = {"tp": "--tp", "pp": "--pp", "pp_split": "--pp-split", "pp_capture": "--pp-capture",
            "cuda_graph": "--cuda-graph", "graph_ids": "--graph-ids", "graph_tokens": "--graph-tokens",
            "mode": "--mode", "strategy": "--strategy", "tbo": "--tbo", "fusion_max_tokens": "--fusion-max-tokens",
            "ep_output": "--ep-output", "dp_padding": "--dp-padding", "dp_local_tokens": "--dp-local-tokens",
            "enable_dp_lm_head": "--enable-dp-lm-head", "json": "--json"}


def add_pd_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disaggregate", metavar="PREFILL_TP:DECODE_TP",
                   help="replay SGLang's PD disaggregation (--disaggregation-mode prefill/decode): the prefill server's "
                        "TP group runs the target and hands the decode server's every rank the EAGLE-3 draft's state "
                        "as --server's version does, over real send/recv (needs --server sglang@VERSION)")
    p.add_argument("--draft-hidden", metavar="N",
                   help="with --disaggregate: the draft's hidden size (default: the target's)")


def pd_sizes(text: str) -> tuple[int, int]:
    """`2:1` -> (2, 1)."""
    head, colon, tail = text.partition(":")
    try:
        sizes = (int(head), int(tail)) if colon else None
    except ValueError:
        sizes = None
    if sizes is None or min(sizes) < 1:
        raise UsageError(f"--disaggregate {text!r} is not PREFILL_TP:DECODE_TP with two positive integers, "
                         "e.g. --disaggregate 2:1")
    return sizes


def draft_hidden(args) -> int | None:
    text = getattr(args, "draft_hidden", None)
    if text is None:
        return None
    if getattr(args, "disaggregate", None) is None:
        raise UsageError("--draft-hidden applies with --disaggregate P:D; add it or drop --draft-hidden")
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 2 or n % 2:
        raise UsageError(f"--draft-hidden {text!r} must be an even integer of at least 2 (the draft's rotary "
                         "embedding splits its head in halves), e.g. --draft-hidden 32")
    return n


def check_alone(args) -> None:
    """--disaggregate with an option whose comparison it does not run: one line naming it."""
    given = sorted(NOT_WITH[d] for d in getattr(args, "given", ()) if d in NOT_WITH)
    if given:
        raise UsageError(f"--disaggregate replays the PD hand-off only, without {given[0]}; drop {given[0]} "
                         "(P:D gives both servers' TP)")
    if args.server is None:
        raise UsageError("--disaggregate replays an engine version's hand-off: add --server sglang@VERSION")
