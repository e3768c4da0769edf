"""SGLang's radix cache replayed (tpsim.parallel.context.PrefixCache) on real gloo ranks: for drawn
configs of every family x TP 1 and 2 (tp and ar-fusion) x a prompt of T tokens whose first N hit the
cache, the forward of the T-N suffix tokens after the prefix forward filled the cache captures, at
every captured position, the full forward's rows N..T-1, and its logits are the full forward's last
T-N rows; it runs the mode's collectives and no more (each rank reads the KV shard it stored). The
same suffix with no cache, or after another prefix, computes something else: the cache is read.
`tpsim check --prefix-cached N` checks the rows after a cache hit and names a stale draft KV per SGLang version."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from clirun import run_cli
from strategies import boundary_positions, config_dicts, token_ids
from test_properties import TINY
from tpsim.base.errors import UsageError
from tpsim.capture import Position, PositionKind
from tpsim.config.loader import config_from_dict, load_config
from tpsim.modes import ArFusion, Mode, SequenceParallel, TensorParallel, expected_collectives
from tpsim.parallel import TPGroup
from tpsim.profiles.prefix import prefix_hit
from tpsim.parallel.context import PrefixCache
from tpsim.run.jobs import build_model, rel_err
from tpsim.run.spec import model_path
from tpsim.testing.jobs import prefix_cache_job

TOL = 1e-5  # float32 ‖Δ‖/‖ref‖: the suffix forward runs other GEMM shapes than the full one
APART = 1e-3  # a suffix that missed its prefix is off by O(1); rounding is 1e-7
LLAMA = load_config(model_path("tiny-llama")).to_dict()
GPT_OSS = load_config(model_path("tiny-gpt-oss")).to_dict()


@st.composite
def prefix_cases(draw):
    tp = draw(st.sampled_from([1, 2]), label="tp")
    cfg = draw(config_dicts(tp, max_layers=2))
    mode = TensorParallel() if tp == 1 else draw(st.sampled_from(
        [TensorParallel(), ArFusion(fusion_max_tokens=draw(st.integers(1, 8), label="fusion_max_tokens"))]))
    T = draw(st.integers(2, 9), label="T")
    n = draw(st.integers(1, T - 1), label="N")
    positions = draw(boundary_positions(cfg["num_hidden_layers"]), label="positions") + [Position(PositionKind.FINAL)]
    ids, other = draw(token_ids(cfg["vocab_size"], T)), draw(token_ids(cfg["vocab_size"], n))
    return tp, cfg, mode, n, positions, draw(st.integers(0, 2**31 - 1), label="seed"), ids, other


def _positions(cfg: dict) -> list[Position]:
    return [Position(PositionKind.EMBED), Position(PositionKind.OUT, cfg["num_hidden_layers"] - 1),
            Position(PositionKind.FINAL)]


def sees_every_token(cfg: dict) -> bool:
    """Whether some layer attends to every earlier token (not a sliding window, which may not reach back
    to the prefix)."""
    c = config_from_dict(cfg)
    return any(c.window(k) is None for k in range(c.num_hidden_layers))


@settings(max_examples=max(8, settings.default.max_examples // 10))
@example(c=(2, TINY, TensorParallel(), 3, _positions(TINY), 0, list(range(3, 11)), [1, 2, 3]))
@example(c=(2, LLAMA, ArFusion(fusion_max_tokens=6), 1, _positions(LLAMA), 1, list(range(7)), [5]))
@example(c=(1, TINY, TensorParallel(), 5, _positions(TINY), 2, list(range(2, 8)), [9, 8, 7, 6, 5]))
@example(c=(2, GPT_OSS, TensorParallel(), 2, _positions(GPT_OSS), 3, list(range(6)), [4, 4]))
@given(c=prefix_cases())
def test_the_suffix_after_a_cached_prefix_is_the_full_forwards_last_rows(rank_pool, c):
    tp, cfg, mode, n, positions, seed, ids, other = c
    T, H, L = len(ids), cfg["hidden_size"], cfg["num_hidden_layers"]
    out = rank_pool.run(prefix_cache_job, cfg=cfg, seed=seed, input_ids=ids, positions=[str(p) for p in positions],
                        tp=tp, mode=mode.to_dict(), n=n, other=other)
    ranks = [out[r] for r in range(tp)]
    (full, full_logits), (cached, cached_logits) = ranks[0]["full"], ranks[0]["cached"]
    for r in ranks:  # the stream is replicated: every rank holds the same capture
        assert all(torch.equal(a, b) for a, b in zip(r["cached"][0], cached)), "ranks differ"
        # one KV entry per layer, the prefix's rows of this rank's heads; reading it is no collective
        assert sorted(r["stored"]) == sorted(f"model.layers.{k}.self_attn.kv_gather" for k in range(L))
        assert all(shape[0] == n for shape in r["stored"].values())
        want = expected_collectives(mode, config_from_dict(cfg), tp)
        assert {op: r["collectives"].count(op) for op in set(r["collectives"])} == want
    assert [tuple(t.shape) for t in cached] == [(T - n, H)] * len(positions)
    assert cached_logits.shape == (T - n, cfg["vocab_size"])
    route = ranks[0]["routing"]
    if all(torch.equal(route["cached"][k], route["full"][k][n:]) for k in route["full"]):  # no near-tie flipped
        for p, got, whole in zip(positions, cached, full):
            assert rel_err(got, whole[n:]) <= TOL, str(p)
        assert rel_err(cached_logits, full_logits[n:]) <= TOL
        # the cache is read: without it, or after another prefix, the logits move (unless every token is
        # the same id, whose value rows are all alike: then no attention can tell the prompts apart)
        if sees_every_token(cfg) and len(set(ids)) > 1:
            assert rel_err(ranks[0]["uncached"][1], full_logits[n:]) > APART
        if sees_every_token(cfg) and other != ids[:n]:
            assert rel_err(ranks[0]["other"][1], full_logits[n:]) > APART


@pytest.mark.parametrize("mode", [SequenceParallel(), Mode.kind("cp")(), TensorParallel(tbo=True)])
def test_a_mode_that_cannot_replay_a_cached_prefix_refuses_it_in_one_line(mode):
    """A forward after a cached prefix in a mode that splits the tokens (sp, cp) or the batch (tbo) would
    compute wrong rows: the model refuses it before any layer runs."""
    cfg = config_from_dict(TINY)
    model = build_model(cfg, TPGroup(), 0, "float32", mode=mode)
    with pytest.raises(UsageError, match=f"--prefix-cached 2 .*(--mode {mode.name}|--tbo)") as e:
        model(torch.arange(4), cache=PrefixCache(2))
    assert "\n" not in str(e.value)


def test_the_prefix_forward_runs_the_cached_tokens_only():
    cache = PrefixCache(3)
    with pytest.raises(ValueError, match="runs the 3 cached tokens, not 5"):
        cache.keys(5)
    with pytest.raises(ValueError, match="at least one token"):
        PrefixCache(0)


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_check_prefix_cached_per_sglang_version(model):
    """`tpsim check --prefix-cached 3` end to end (MLA and GQA). SGLang 0.5.2 keys the radix tree by tokens: the 3
    shared positions are reused, the draft's KV at position 2 with them (computed with another request's token 3):
    exit 1, the finding at both degrees, the fix that replays clean. From 0.5.3 (#10846) token pairs: 2 positions
    reused, the prefill re-runs 2..7: exit 0. Either way the capture's rows are the full prompt's."""
    args = ["check", "--prefix-cached", "3", "--tp", "1,2", "--seq-len", "8", "--model", model]
    old = run_cli(*args, "--server", "sglang@0.5.2")
    assert old.returncode == 1, old
    for tp in (1, 2):
        assert (f"FAIL TP={tp}: prefix cache: sglang@0.5.2 keys the radix tree by tokens, so the hit reuses all 3 "
                "shared positions, the draft's KV at position 2 with them") in old.stdout, old
    assert "fix: serve with sglang 0.5.3 or later (#10846): the same hit reuses 2 positions" in old.stdout, old
    assert "holds tokens 3..7, equal to the TP=1 full-prompt reference's rows 3..7" in old.stdout, old
    assert not any(line.startswith("FAIL") and "prefix cache" not in line for line in old.stdout.splitlines()), old
    new = run_cli(*args, "--server", "sglang@0.5.3")
    assert new.returncode == 0, new
    assert "holds tokens 2..7, equal to the TP=1 full-prompt reference's rows 2..7" in new.stdout, new
    assert "[6, 192]" in new.stdout, new


@given(shared=st.integers(1, 40), version=st.sampled_from(["0.5.2", "0.5.3", "0.5.12", "0.5.23", "latest"]))
def test_a_hit_reuses_the_shared_tokens_or_one_fewer(shared, version):
    """Keyed by tokens a hit reuses every shared position (the last one's draft KV stale); keyed by pairs one fewer
    (nothing stale); the fix a stale hit names is a version where the same hit is not stale."""
    hit = prefix_hit(f"sglang@{version}", shared)
    tokens = version == "0.5.2"
    assert hit.reused == (shared if tokens else shared - 1) and hit.stale == tokens
    later = hit.fixed_in()
    assert (later is not None) == tokens
    if later is not None:
        assert prefix_hit(f"sglang@{later.release}", shared).stale is False


def test_the_radix_cache_is_sglangs_and_read_from_0_5_2():
    for server, words in (("vllm@0.34.0", "of sglang only"), ("sglang@0.5.1", "from 0.5.2 on")):
        r = run_cli("check", "--prefix-cached", "3", "--server", server)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r


@given(prefix=st.lists(st.integers(0, 9), min_size=0, max_size=8), tails=st.lists(
    st.lists(st.integers(0, 9), min_size=2, max_size=6), min_size=1, max_size=4))
def test_requests_served_in_order_reuse_a_stale_draft_kv_only_under_token_keys(prefix, tails):
    """Requests sharing a prefix, served one after another: keyed by tokens each reuses the draft KV at its last
    shared position, computed with the previous request's next token (where that differs); keyed by pairs none."""
    from tpsim.profiles.prefix import RadixKeys, served_in_order
    requests = [(tuple(prefix + t), len(prefix) + len(t) - 1) for t in tails]
    tokens_keyed = served_in_order(RadixKeys.TOKENS, requests)
    assert served_in_order(RadixKeys.BIGRAMS, requests) == [None] * len(requests)
    assert len(tokens_keyed) == len(requests) and tokens_keyed[0] is None
    for (before, _), (now, prompt), stale in zip(requests, requests[1:], tokens_keyed[1:]):
        if stale is not None:
            row, token = stale
            assert now[:row + 1] == before[:row + 1] and token == before[row + 1] != now[row + 1]
            assert row + 1 < prompt
