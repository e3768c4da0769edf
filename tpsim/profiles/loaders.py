"""What each engine's EAGLE-3 draft loader does with a draft checkpoint, per version, as data (`tpsim draft
--server`): the tensors it reads, skips or refuses, the norm keys of config.json it honours, and whose
embedding the draft runs on. Each behaviour is `Cited` to the file read; the data are in loader_lines.py.

A `LoaderLine` is one engine's draft loader over time: the behaviour of the oldest release read (`base`) and the
`Change`s later releases made (each names the first release whose code has it, read from the released wheels).
Before the oldest release read nothing is claimed: loader_lines.lookup gives no `Loader` there (UNVERIFIED).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from tpsim.profiles.cited import Change, Cited


class Fate(Enum):
    """What a loader does with one tensor of the checkpoint."""

    READ = "read"
    SKIPPED = "skipped without an error"
    REFUSED = "refused: weight loading raises and the server does not start"


class Use(Enum):
    """Whether a loader applies one of the draft config's norm switches (`Norm`) or runs its default."""

    HONOURED = "honoured"
    IGNORED = "ignored"


class EmbedUse(Enum):
    """Whose embed_tokens the served draft runs on (one stage, no pipeline parallelism)."""

    TARGETS_IF_SAME_SHAPE = ("the target's when its shape is the draft's; else the draft's own, loaded from the "
                             "checkpoint (uninitialised where it has none)")
    OWN_IF_DISTINCT = "the target's when the draft has none or an identical one; a distinct one of its own is kept"
    TARGETS_UNLESS_WIDTHS = ("the target's, unless the draft config's target_hidden_size differs from its hidden_size: "
                             "then the draft's own, loaded from the checkpoint (uninitialised where it has none)")

    def keeps_own(self, same_shape: bool, widths_differ: bool = False) -> bool:
        """Whether a draft's own embedding, distinct from the target's, is what the served draft runs on
        (`same_shape`: the draft's embedding has the target's shape; `widths_differ`: the draft config's
        target_hidden_size is not its hidden_size)."""
        return self is EmbedUse.OWN_IF_DISTINCT or (self is EmbedUse.TARGETS_IF_SAME_SHAPE and not same_shape) or \
            (self is EmbedUse.TARGETS_UNLESS_WIDTHS and widths_differ)


class AuxCount(Enum):
    """How many aux hidden states the loader builds fc for (fc takes that many x target_hidden_size)."""

    THREE = "three, always: num_aux_hidden_states and the number of layer ids are not read"
    FROM_CONFIG = "num_aux_hidden_states, else the number of eagle_config's layer ids, else three"

    def count(self, num_aux_hidden_states: int | None, ids: tuple[int, ...] | None) -> int:
        if self is AuxCount.THREE:
            return 3
        return num_aux_hidden_states or (len(ids) if ids else 3)


class Norm(Enum):
    """The draft config's norm keys (research doc §2.1)."""

    NORM_BEFORE_FC = "norm_before_fc"
    FC_NORM = "fc_norm"
    NORM_OUTPUT = "norm_output"
    NORM_BEFORE_RESIDUAL = "norm_before_residual"

    @property
    def weights(self) -> str | None:
        """The prefix of the tensors the key brings (None: it brings none)."""
        return {Norm.NORM_BEFORE_FC: "input_norm.", Norm.FC_NORM: "fc_norm."}.get(self)

    @property
    def effect(self) -> str:
        """What the draft computes differently from its training when the key is ignored."""
        return {Norm.NORM_BEFORE_FC: "fc projects the capture without the RMSNorm (input_norm) the draft was "
                                     "trained with (SGLang PR #32334: norm_before_fc ignored -> low acceptance)",
                Norm.FC_NORM: "fc gets the aux chunks without their per-chunk RMSNorm (fc_norm.N)",
                Norm.NORM_OUTPUT: "later draft steps are fed the pre-norm hidden state, not the normed one the "
                                  "draft was trained on",
                Norm.NORM_BEFORE_RESIDUAL: "the residual is taken before hidden_norm, not after it as trained"}[self]


@dataclass(frozen=True)
class Loader:
    """One engine version's draft loader, each behaviour cited."""

    unknown: Cited[Fate]  # a tensor the draft model has no parameter for
    norm_before_fc: Cited[Use]
    fc_norm: Cited[Use]
    norm_output: Cited[Use]
    norm_before_residual: Cited[Use]
    nested_norm_before_fc: Cited[bool]  # eagle_config.norm_before_fc read (before the top-level key)
    idle_input_norm: Cited[Fate]  # input_norm.* while norm_before_fc is off
    aux_off_fc: Cited[Fate]  # fc.* when eagle_config.use_aux_hidden_state is false
    embed: Cited[EmbedUse]
    aux_count: Cited[AuxCount] | None = None  # None: not read for this engine's releases (UNVERIFIED)

    def use(self, norm: Norm) -> Cited[Use]:
        return getattr(self, norm.value)


@dataclass(frozen=True)
class LoaderLine:
    engine: str
    path: str  # the draft model file
    oldest: str  # the oldest release read: before it the behaviour is UNVERIFIED
    newest: str  # the newest release read
    reads: Cited[frozenset[str]]  # the checkpoint's tensor names the draft model has a parameter for
    base: Loader
    changes: tuple[Change, ...] = ()

    def first(self, norm: Norm, top: bool = True, nested: bool | None = None) -> str | None:
        """The first release read that honours `norm` and reads it as set, for a config with `top` at the top level
        and `nested` as eagle_config.norm_before_fc (None: absent; only norm_before_fc has the nested key). None:
        no release read does."""
        state, release = self.base, self.oldest
        for change in (None, *self.changes):
            if change is not None:
                state, release = replace(state, **change.changes), change.release
            reads_nested = norm is Norm.NORM_BEFORE_FC and nested is not None and state.nested_norm_before_fc.value
            if state.use(norm).value is Use.HONOURED and (nested if reads_nested else top):
                return release
        return None


@dataclass(frozen=True)
class ServedLoader:
    """`--server`'s profile: `loader` is None for a version older than the oldest release read."""

    name: str  # ENGINE@VERSION as asked (`latest` when no version was given)
    line: LoaderLine
    loader: Loader | None
