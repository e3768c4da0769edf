"""Reading what `torch.save` wrote without running code in it (`weights_only`), and an exception's first line for
a one-line refusal (torch's own errors carry terminal colours and run to several lines)."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from tpsim.base.errors import UsageError

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch's weights-only error bolds a phrase


def short_error(e: BaseException) -> str:
    text = ANSI.sub("", str(e)).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def load_pt(path: Path, fix: str = "pass tensor dumps only"):
    """What torch.save wrote to `path`, read with weights_only (no code in it runs), or one line and the `fix`."""
    try:
        with warnings.catch_warnings():  # torch warns (two lines) about a pickle protocol before refusing it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"{path} cannot be read with torch.load(weights_only=True) ({_unpickled(e)}); {fix}") \
            from None


def _unpickled(e: BaseException) -> str:
    """Why torch.load refused: for a weights-only refusal its reason alone, without torch's advice to load with
    weights_only=False (which runs whatever code the file holds)."""
    _, cue, rest = ANSI.sub("", str(e)).partition("WeightsUnpickler error:")
    reason = next((line.strip() for line in rest.splitlines() if line.strip()), "")
    if not isinstance(e, pickle.UnpicklingError) or not cue:
        return short_error(e)
    return f"not a torch.save file of tensors alone: {reason[:80]}; nothing in it was run"
