"""What a run does with the options: the TP degrees, the mode, the model source, the typed request
(RunRequest) and the RunSpec it builds, every value validated here, once, before any rank starts.
A command imports this when it runs (torch with it), not for --help (tpsim.cli.options)."""

from __future__ import annotations

from tpsim.app.preflight import check_divides_world, check_timeout, max_cpu_ranks, torchrun_world
from tpsim.app.request import Ids, RunRequest
from tpsim.app.run_options import GraphsAsk, PipelineAsk
from tpsim.base.environ import under_torchrun
from tpsim.base.errors import UsageError
from tpsim.cli.options import DEFAULT_TP, int_list, integer, positive_int
from tpsim.cli.pp_options import pp_degree
from tpsim.modes import Mode, Strategy, TensorParallel, tbo
from tpsim.profiles.resolution import Resolution
from tpsim.run.spec import ModelSource, RunSpec


def load_source(args, tps: list[int]) -> ModelSource:
    mode = getattr(args, "mode", None)
    if mode is not None and Mode.kind(mode).whole_weights:  # every weight whole on each rank: nothing split
        tps = []
    return ModelSource.load(args.model, args.override or [], tps)


# --option -> the mode field it sets; the mode that owns the field says where it applies
MODE_OPTIONS = (("--fusion-max-tokens", "fusion_max_tokens", "fusion_max_tokens"), ("--ep-output", "ep_output", "ep_output"),
                ("--dp-padding", "dp_padding", "dp_padding"), ("--enable-dp-lm-head", "enable_dp_lm_head", "dp_lm_head"),
                ("--dp-local-tokens", "dp_local_tokens", "dp_local_tokens"))


def mode_of(args) -> Mode:
    """The Mode the --mode options name (each option refused where its mode is not the one named)."""
    kind = Mode.kind(args.mode)
    given = {name: getattr(args, attr) for option, attr, name in MODE_OPTIONS if getattr(args, attr) is not None}
    for option, attr, name in MODE_OPTIONS:
        if name in given and name not in kind.options():
            raise UsageError(f"{option} applies to --mode {Mode.owner(name).name} only, not --mode {args.mode}")
    if "fusion_max_tokens" in given:
        given["fusion_max_tokens"] = integer(given["fusion_max_tokens"], "--fusion-max-tokens")
    if getattr(args, "tbo", False):
        if "tbo" not in kind.options():
            raise tbo.not_in_mode(args.mode)
        given["tbo"] = True
    return kind(**given)


def one_tp(args) -> int:
    """--tp of a command that runs one degree: DEFAULT_TP, or the torchrun world."""
    if args.tp is None:
        return torchrun_world() if under_torchrun() else DEFAULT_TP
    tp = positive_int(args.tp, "--tp")
    check_divides_world(tp)
    return tp


def served_tp(args) -> int:
    """--tp of a command about a served deployment: 1 (an engine's own default), or the torchrun world."""
    return 1 if args.tp is None and not under_torchrun() else one_tp(args)


def tp_degrees(args) -> list[int]:
    """--tp as a sorted list of degrees (default 1,2,4,8; under torchrun every divisor of the world)."""
    if args.tp is None:
        world = torchrun_world()
        return [t for t in range(1, world + 1) if world % t == 0] if under_torchrun() else [1, 2, 4, 8]
    tps = int_list(args.tp, "--tp")
    for t in tps:
        if t < 1:
            raise UsageError(f"--tp {t} must be a positive integer")
        check_divides_world(t)
    return sorted(set(tps))


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


def request_from(args, tps: list[int]) -> RunRequest:
    """argv's options as the typed request (each command's parser says which options it has)."""
    given = vars(args)
    tokens, seq_len, size = given.get("tokens"), given.get("seq_len"), given.get("graph_tokens")
    cached = given.get("prefix_cached")
    return RunRequest(
        model=args.model, overrides=tuple(args.override or ()), tps=tuple(tps), seed=args.seed, dtype=args.dtype,
        weights=given.get("weights"), compile=given.get("compile"), device=args.device, backend=args.backend,
        timeout=args.timeout, ignore_limits=args.ignore_limits,
        tokens=None if tokens is None else tuple(int_list(tokens, "--tokens")),
        seq_len=None if seq_len is None else positive_int(seq_len, "--seq-len"),
        ids=Ids(None if given.get("layers") is None else tuple(int_list(args.layers, "--layers")),
                given.get("convention"), given.get("server"), given.get("draft_config")),
        mode=mode_of(args) if "mode" in given else TensorParallel(), strategy=given.get("strategy"),
        tbo_asked=bool(given.get("tbo")),
        pipeline=PipelineAsk(pp_degree(args), given.get("pp_split"), given.get("pp_capture")),
        graphs=GraphsAsk(bool(given.get("cuda_graph")), given.get("graph_ids"),
                         None if size is None else integer(size, "--graph-tokens", example=", e.g. --graph-tokens 4")),
        prefix_cached=None if cached is None else integer(cached, "--prefix-cached", example=", e.g. --prefix-cached 3"))


def run_spec(args, tps: list[int], source: ModelSource | None = None, positions=None,
             mode: tuple[Mode, Strategy] | None = None) -> tuple[RunSpec, Resolution | None]:
    """Everything validated before any rank starts (`mode`: the mode and strategy when the caller
    decided them, else the --mode options)."""
    check_timeout(args.timeout)
    return request_from(args, tps).spec(source, positions, mode)
