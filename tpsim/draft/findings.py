"""What reading a draft checkpoint finds: one typed object per defect, with its cause, source and fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class DraftDefect(Enum):
    FC_WIDTH = "fc-width"  # fc's input width is not num_aux x the target's hidden size
    VOCAB_MAP = "vocab-map"  # d2t / t2d disagree with each other or with the vocab sizes
    EMBED_ABSENT = "embed-absent"  # no embed_tokens.weight (SpecForge's SGLang export drops it)
    IGNORED_KEY = "ignored-key"  # a tensor no loader of this layout reads
    MISSING_KEY = "missing-key"  # a tensor the config calls for is not there
    SHAPE = "shape"  # a tensor the draft reads has the wrong shape


@dataclass(frozen=True)
class DraftFinding:
    defect: DraftDefect
    cause: str
    source: str
    fix: str
    key: str | None = None

    def line(self) -> str:
        return f"{self.defect.value}: {self.cause} [{self.source}] fix: {self.fix}"
