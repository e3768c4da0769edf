"""triage's findings from served flags whose behaviour lives outside the model files (tpsim.profiles.history):
SGLang's radix cache (on unless --disable-radix-cache), the prefill/decode hand-off under
--disaggregation-mode, and vLLM's merge of the micro-batches under --enable-dbo. Each names the version's behaviour as read and the first version where it is fixed; the
fixes are replayed by tpsim.app.remedies (the same triage run on the fixed version, or with the flag)."""

from __future__ import annotations

from dataclasses import replace

from tpsim.draft.config import KEY, aux_count, check_keys
from tpsim.profiles.algorithm import EAGLE_SERVED, FC_GATE, FLAG, DraftShape, eagle_served, fc_runs
from tpsim.profiles.findings import Finding, Kind
from tpsim.profiles.history import Held, History
from tpsim.profiles.loader_lines import lookup
from tpsim.profiles.pd import Widths
from tpsim.profiles.pd_versions import PD
from tpsim.profiles.prefix import RADIX, RadixKeys
from tpsim.profiles.profile import Profile, Served, SpecAlgorithm
from tpsim.profiles.registry import CPU_BUILD
from tpsim.profiles.ubatch import UBATCH


HISTORY_OF = {Kind.PREFIX_CACHE: RADIX, Kind.PD_HANDOFF: PD, Kind.UBATCH_MERGE: UBATCH}  # kept outside the model files


def flag_behaviour(history: History, serve: Profile, served: Served, on: bool) -> Held | None:
    """The behaviour of `history` at the served version, when its flag is `on` for that engine and the version
    was read (else None: a version before the oldest read is unread_notes')."""
    server = served.server or serve.name
    return history.at(server) if on and serve.engine == history.engine and history.read(server) else None


def radix_findings(serve: Profile, served: Served) -> list[Finding]:
    """A radix cache keyed by tokens: every prefix hit reuses the draft's KV at its last shared position."""
    held = flag_behaviour(RADIX, serve, served, served.radix_cache)
    if held is None or held.value is not RadixKeys.TOKENS:
        return []
    later = held.later(lambda keys: keys is not RadixKeys.TOKENS)
    fix = f"serve with sglang {Held.upgrade(later)}, or --disable-radix-cache" if later else "--disable-radix-cache"
    return [Finding(Kind.PREFIX_CACHE,
                    f"{held.server} serves with its radix cache on and {held.value.value}: a prompt that shares its "
                    "first N tokens with a cached request reuses the draft's KV at position N-1 too, computed with "
                    "that request's token N, not this one's: every later draft step attends to a key and value this "
                    "request never had (sglang PR #10846: acceptance length 2.26 with the radix cache against 2.39 "
                    "without; tpsim check --prefix-cached N replays a hit)", [str(held.cited.source)],
                    fix)]


def pd_findings(serve: Profile, served: Served, target_hidden: int, draft_hidden: int, slots: int) -> list[Finding]:
    """Under --disaggregation-mode: the state the prefill server sends against the decode server's buffer."""
    held, w = flag_behaviour(PD, serve, served, served.disaggregated), Widths(target_hidden, draft_hidden, slots or 3)
    if held is None or held.value.fits(w):
        return []
    later = held.later(lambda t: t.fits(w))
    fix = f"serve with sglang {Held.upgrade(later)}" if later else "no version tpsim read hands this state off"
    return [Finding(Kind.PD_HANDOFF,
                    f"PD disaggregation on {held.server}: the prefill server sends {held.value.sent_text(w)} values "
                    f"per request ({held.value.what}) into the decode server's {held.value.buffer(w)}-wide buffer: "
                    f"{held.cited.error or 'shape error'} (tpsim check --disaggregate replays the transfer)",
                    [str(held.cited.source)], fix)]


def ubatch_findings(serve: Profile, served: Served) -> list[Finding]:
    """vLLM's --enable-dbo with EAGLE-3: the micro-batches' outputs, (hidden, [aux...]) tuples, merged as tensors."""
    held = flag_behaviour(UBATCH, serve, served, served.dbo)
    if held is None or not held.value.fails:
        return []
    later = held.later(lambda merge: not merge.fails)
    return [Finding(Kind.UBATCH_MERGE,
                    f"{held.server} with --enable-dbo: {held.value.value}: the target returns (hidden_states, "
                    f"aux_hidden_states) per micro-batch under EAGLE-3, and the server fails at start-up: "
                    f"{held.cited.error}", [str(held.cited.source)],
                    f"serve with vllm {Held.upgrade(later)}, or without --enable-dbo")]


def served_as_eagle(serve: Profile, served: Served, raw: dict) -> tuple[Held, DraftShape] | None:
    """What `serve` does with the draft of config `raw` when launched under the EAGLE algorithm (SGLang
    --speculative-algorithm, vLLM's method), and the draft's shape; None unless an EAGLE-3 draft is served so."""
    history = EAGLE_SERVED.get(serve.engine)
    eagle = served.algorithm is SpecAlgorithm.EAGLE
    as_vllm = replace(served, server=served.server.replace(CPU_BUILD, "vllm", 1))  # the CPU build is vLLM's code
    held = flag_behaviour(history, serve, as_vllm, eagle) if history is not None else None
    shape = draft_shape(raw)
    return None if held is None or not shape.eagle3 else (held, shape)


def fc_findings(serve: Profile, served: Served, raw: dict, target_hidden: int, slots: int) -> list[Finding]:
    """An EAGLE-3 draft served under EAGLE3 whose `slots` captured states are together as wide as its embedding:
    SGLang's width test skips fc (under EAGLE algorithm_findings says what it is handed instead). Only where the
    version's draft loader builds fc for those `slots` states: one built for another count refuses the draft's fc
    (`tpsim draft --server` says so) or its width differs."""
    shape = draft_shape(raw)
    width = slots * target_hidden
    if served.algorithm is SpecAlgorithm.EAGLE or not slots or not shape.eagle3 or \
            fc_runs(serve.engine, width, shape.hidden):
        return []
    loader = lookup(served.server or serve.name).loader  # None: a release before the oldest read (UNVERIFIED)
    count = None if loader is None else loader.aux_count
    keys = check_keys(raw, "draft config")
    ids = (keys.get("eagle_config") or {}).get(KEY)  # SGLang counts eagle_config's ids only
    if count is None or count.value.count(keys.get("num_aux_hidden_states"), tuple(ids or ())) != slots:
        return []
    gate = FC_GATE[serve.engine]
    return [Finding(Kind.FC_SKIPPED,
                    f"{served.server or serve.name} captures {slots} aux hidden state{'s' if slots > 1 else ''}, "
                    f"{slots} x {target_hidden} = {width} wide, as wide as the draft's embedding ({shape.hidden}): "
                    f"{gate.value.value}, so fc ({shape.fc_in} -> {shape.hidden}) is skipped silently and the draft "
                    "reads the capture un-projected, where training ran fc on it (no flag or config key changes the "
                    "test: it compares widths in llama_eagle3.py's forward)", [str(gate.source)], None)]


def algorithm_findings(serve: Profile, served: Served, raw: dict) -> list[Finding]:
    """An EAGLE-3 draft launched under the EAGLE algorithm."""
    found = served_as_eagle(serve, served, raw)
    if found is None:
        return []
    held, shape = found
    return [Finding(Kind.ALGORITHM, f"an EAGLE-3 draft served as EAGLE: {eagle_served(held.value, shape, held.server)}",
                    [str(held.cited.source)], f"serve with {FLAG[serve.engine]}")]


def draft_shape(raw: dict) -> DraftShape:
    """The draft config's architectures, hidden sizes and the width its fc takes (aux states x target width)."""
    keys = check_keys(raw, "draft config")
    hidden = keys.get("hidden_size") or 0
    target = keys.get("target_hidden_size") or hidden
    vocab, draft_vocab = keys.get("vocab_size"), keys.get("draft_vocab_size")
    archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    return DraftShape(tuple(str(a) for a in archs), hidden, target, target * aux_count(keys),
                      isinstance(draft_vocab, int) and isinstance(vocab, int) and draft_vocab < vocab)


def unread_notes(serve: Profile, served: Served) -> list[str]:
    """The served flags whose behaviour tpsim did not read for this version: UNVERIFIED, not judged."""
    server = served.server or serve.name
    asked = [(RADIX, served.radix_cache), (PD, served.disaggregated), (UBATCH, served.dbo),
             *[(h, served.algorithm is SpecAlgorithm.EAGLE) for h in EAGLE_SERVED.values()]]
    return [f"UNVERIFIED: {h.what} of {server}: tpsim read {h.engine}'s from {h.oldest} on, so it is not judged"
            for h, on in asked if on and serve.engine == h.engine and not h.read(server)]
