"""What reading a draft checkpoint finds: one typed object per defect, with its cause, source and fix."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class DraftDefect(Enum):
    """What is wrong with a draft checkpoint; the value is the finding's `defect` in `tpsim draft --json`."""

    FC_WIDTH = "fc-width"  # fc's input width is not num_aux x the target's hidden size
    VOCAB_MAP = "vocab-map"  # d2t / t2d disagree with each other or with the vocab sizes
    EMBED_ABSENT = "embed-absent"  # no embed_tokens.weight (SpecForge's SGLang export drops it)
    IGNORED_KEY = "ignored-key"  # a tensor no loader of this layout reads
    MISSING_KEY = "missing-key"  # a tensor the config calls for is not there
    SHAPE = "shape"  # a tensor the draft reads has the wrong shape
    DTYPE = "dtype"  # a tensor the draft reads has a dtype it cannot be (a bool or int weight, a float d2t)
    NON_FINITE = "non-finite"  # a tensor the draft reads holds NaN or Inf
    CONFLICT = "conflicting-shards"  # two weight files hold one tensor with different values
    # what a named engine version's loader does with it (`tpsim draft --server`, tpsim/profiles/loaders.py)
    LOADER_SKIPS = "loader-skips-key"  # a tensor that engine's loader skips without an error
    LOADER_REFUSES = "loader-refuses-key"  # a tensor that engine's loader refuses: it does not start
    NORM_IGNORED = "norm-ignored"  # a norm key of the config that engine version does not honour
    EMBED_DIFFERS = "embed-differs"  # embed_tokens is not the target's, and that engine runs the draft on it
    IDS_UNREAD = "ids-unread"  # the config's layer ids sit where that engine version does not read them (or fail)
    IDS_MISREAD = "ids-misread"  # that version reads the ids, and captures other layers than the trainer did
    IDS_LUCKY = "ids-unread-default-coincides"  # ids-unread, but that version's default captures the same layers
    EMBED_VERDICT = "embed-verdict-split"  # TP ranks disagree on whether embed_tokens is the target's (vllm #50158)
    VERIFY_NO_BROADCAST = "verify-no-broadcast"  # ranks accept their own count of drafts (sglang #31071)
    UNVERIFIED = "unverified"  # the draft relies on loader behaviour tpsim has not read for that version


@dataclass(frozen=True)
class DraftFinding:
    defect: DraftDefect
    cause: str
    source: str
    fix: str
    key: str | None = None
    server: str | None = None  # the engine version whose loader this is about (None: the layout itself)

    @property
    def warning(self) -> bool:
        """Works as it stands, by coincidence: said as a WARNING with its safeguard, not counted as a finding."""
        return self.defect is DraftDefect.IDS_LUCKY

    @property
    def title(self) -> str:
        return self.defect.value + (f" ({self.key})" if self.key else "") + (f" [{self.server}]" if self.server else "")

    def to_dict(self) -> dict:
        return {"defect": self.defect.value, "cause": self.cause, "source": self.source, "fix": self.fix,
                "key": self.key, "server": self.server}

    def line(self) -> str:
        return f"{self.defect.value}: {self.cause} [{self.source}] fix: {self.fix}"


@dataclass(frozen=True)
class TitledFinding:
    """A finding about a draft tpsim reads but does not load (a DFlash or DSpark draft's taps, an MTP head's feed):
    its headline, why, the released code that shows it, and the fix (replayed by the command that prints it)."""

    title: str
    cause: str
    sources: tuple[str, ...]
    fix: str

    def to_dict(self) -> dict:
        return {"title": self.title, "cause": self.cause, "sources": list(self.sources), "fix": self.fix}
