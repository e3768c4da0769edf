"""SGLang's radix (prefix) cache under EAGLE, per version: how many positions a prompt that shares its first N
tokens with a cached request reuses, and whether the draft's KV at the last of them is this request's.

The draft's step 0 at position i reads [token i+1, the capture at i]: its KV there depends on the next token. Keyed
by tokens (up to 0.5.2) a hit of N shared tokens reuses positions 0..N-1, the draft's KV at N-1 with them, computed
with the cached request's token N, which this request does not share (the prompts diverge there). PR #10846 (first
in 0.5.3) keys the tree by token pairs under EAGLE: N-1 positions are reused and the prefill re-runs N-1."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tpsim.profiles import sglang_server
from tpsim.profiles.history import Held, History
from tpsim.profiles.cited import Change, Cited

RADIX_FILE = "mem_cache/radix_cache.py"


class RadixKeys(Enum):
    """What the radix cache's tree is keyed by: decides how many cached positions a hit reuses."""

    TOKENS = "the tree is keyed by tokens: a hit of N shared tokens reuses positions 0..N-1"
    BIGRAMS = "under EAGLE the tree is keyed by token pairs (t_i, t_i+1): a hit of N shared tokens reuses 0..N-2"

    def reused(self, shared: int) -> int:
        return shared if self is RadixKeys.TOKENS else shared - 1


TOKEN_KEYS = Cited(RadixKeys.TOKENS, sglang_server.src(
    RADIX_FILE, "v0.5.2", "RadixCache.match_prefix", "def match_prefix(self, key: List[int], **kwargs) -> MatchResult:",
    "the key is the request's token ids whatever the speculative algorithm: the matched prefix's KV (the target's and "
    "the draft's, one index per token) is reused whole; 0.5.2 has no EAGLE case in the file"))
BIGRAM_KEYS = Change(("#10846",), "Fix eagle radix cache: EAGLE keys the radix tree by token pairs", None, "0.5.3", {
    "radix": Cited(RadixKeys.BIGRAMS, sglang_server.src(
        RADIX_FILE, "v0.5.3", "RadixCache.cache_unfinished_req",
        "# The actual kv len for EAGLE is len(token_ids), since EAGLE uses bigram key actual_kv_len = all_token_len - "
        "1 if self.is_eagle else all_token_len",
        "_convert_to_bigram_key: '# EAGLE uses bigram keys in the radix tree since draft sequence is the "
        "one-token-shifted version of target'; PR #10846 measured acceptance length 2.39 without the radix cache, "
        "2.26 with it, 2.39 with the fix (Llama-3.1-8B-Instruct, lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B, MT-bench); "
        "first in 0.5.3, absent from 0.5.2; later releases not re-read"))})
RADIX = History("sglang", "the radix cache's keys under EAGLE", "radix", TOKEN_KEYS, (BIGRAM_KEYS,), "0.5.2",
                sglang_server.RELEASES)
NOT_REPLAYED = ("the draft's own KV for cached positions under spec V2, never written on a prefix hit -> NaN (sglang "
                "issue #19796; PR #19897, which zero-fills it, closed unmerged; the fix's release not found): not "
                "replayed")


@dataclass(frozen=True)
class PrefixHit:
    """A prompt that shares its first `shared` tokens with a request the radix cache holds, on one version."""

    shared: int
    held: Held[RadixKeys]

    @property
    def keys(self) -> RadixKeys:
        return self.held.value

    @property
    def reused(self) -> int:
        return self.keys.reused(self.shared)

    @property
    def stale(self) -> bool:
        """The draft's KV at the last reused position was computed with another request's next token."""
        return self.reused == self.shared

    def fixed_in(self) -> Change | None:
        """The first later change under which the same hit reuses nothing stale (replayed: PrefixHit again)."""
        return self.held.later(lambda keys: keys.reused(self.shared) < self.shared)


def prefix_hit(server: str | None, shared: int) -> PrefixHit:
    return PrefixHit(shared, RADIX.at(server or "sglang"))


def served_in_order(keys: RadixKeys, requests: list[tuple[tuple[int, ...], int]]) -> list[tuple[int, int] | None]:
    """Requests (tokens, prompt length) served one after another with the radix cache on: request i's prompt
    shares its first N tokens with request i-1 (prompt and answer, cached when it finished). Per request, the draft
    KV it reuses stale: (row N-1, request i-1's token N) where the keys reuse all N positions, else None."""
    out: list[tuple[int, int] | None] = [None] * min(len(requests), 1)
    for (before, _), (tokens, prompt) in zip(requests, requests[1:]):
        n = 0
        while n < min(prompt - 1, len(before) - 1) and tokens[n] == before[n]:
            n += 1
        reused = keys.reused(n) if n else 0
        out.append((n - 1, before[n]) if reused == n and n and before[n] != tokens[n] else None)
    return out
