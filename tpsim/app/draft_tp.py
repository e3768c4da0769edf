"""`tpsim draft --server ... --tp N`: the draft under TP replayed on real gloo ranks (tpsim.run.draft_tp_jobs) for
each engine version named: its lm_head's vocabulary split as that engine pads it (SGLang accepts what vLLM refuses:
the sharded logits are checked against the unsharded ones), vLLM's per-rank embed_tokens verdicts (the ranks whose
verdicts differ are named, with the module each rank's draft then holds), and, with --platform, SGLang's greedy
verify without a TP broadcast (ranks that accept different counts are named before the collective that would
deadlock). Every fix printed is replayed on the same ranks first."""

from __future__ import annotations

import torch

from tpsim.parallel.pool import RankPool
from tpsim.draft.checkpoint import DraftCheckpoint
from tpsim.draft.findings import DraftDefect, DraftFinding
from tpsim.profiles import draft_tp as cited
from tpsim.profiles.profile import Platform
from tpsim.profiles.loaders import ServedLoader
from tpsim.profiles.cited import Change
from tpsim.profiles.registry import RELEASES, version_key, when
from tpsim.run import draft_tp_jobs as jobs
from tpsim.weights.seeded import init_tensor

TIMEOUT_S = 60.0
VERIFY_STEPS = 3  # drafts per verify round, as tpsim acceptance's default --steps


def ranks(tp: int) -> RankPool:
    """`tp` self-started gloo ranks, every collective with TIMEOUT_S: one pool for every replay of a command."""
    return RankPool(tp, "gloo", "cpu", TIMEOUT_S)


def on_ranks(pool: RankPool, job, **kwargs) -> list:
    """[rank 0's result, ...] of `job` on the pool's ranks."""
    got = pool.run(job, tp=pool.world, **kwargs)
    return [got[r] for r in range(pool.world)]


# --- 1. the vocabulary split -------------------------------------------------------------------------------------

def split_of(s: ServedLoader, platform: Platform | None) -> cited.VocabSplit:
    """How `s` pads the draft's vocabulary on `platform` (None: a GPU)."""
    engine, _, version = s.name.partition("@")
    engine = s.line.engine
    later = when(engine, version or "latest").has(Change((), "", None, cited.SGLANG_PADS_EVERYWHERE, {}),
                                                  RELEASES[engine]) if engine == "sglang" else False
    return cited.vocab_split(engine, later, platform is Platform.CPU)


def vocab_replay(pool: RankPool, vocab: int, hidden: int, split: cited.VocabSplit, seed: int = 0) \
        -> tuple[str | None, bool]:
    """(the engine's refusal or None, whether the sharded draft's logits equal the unsharded draft's on the pool's
    ranks (True where refused: nothing runs))."""
    tp = pool.world
    refused = split.refusal(vocab, tp)
    if refused:
        return refused, True
    weight = init_tensor(seed, "lm_head.weight", (vocab, hidden), "cpu")
    x = init_tensor(seed, "draft.hidden", (4, hidden), "cpu")
    every = on_ranks(pool, jobs.sharded_head, weight=weight, rows=split.rows(vocab, tp), hidden=x)
    full = torch.nn.functional.linear(x, weight)
    return None, all(torch.allclose(r, full, rtol=1e-5, atol=1e-6) and torch.equal(r, every[0]) for r in every)


def vocab_findings(pool: RankPool, ckpt: DraftCheckpoint, s: ServedLoader, platform: Platform | None,
                   notes: list[str]) -> list[DraftFinding]:
    """SGLang's refusal of the split (vLLM's is draft_served.vocab_split's finding); where the engine accepts it, a
    note of the replay on the pool's ranks."""
    vocab, tp, hidden = ckpt.config.draft_vocab_size, pool.world, min(ckpt.config.hidden_size, 64)
    split = split_of(s, platform)
    refused, same = vocab_replay(pool, vocab, hidden, split)
    where = (platform or Platform.CUDA).value
    if not refused:
        rows = split.rows(vocab, tp)
        notes.append(f"{s.name} on {where} splits the draft's lm_head ({vocab} rows padded to {rows}, {rows // tp} a "
                     f"rank) over TP {tp}: replayed on {tp} gloo ranks, the sharded logits "
                     f"{'equal' if same else 'DIFFER FROM'} the unsharded draft's [{split.pads_by_tp.source}]")
        return []
    if s.line.engine != "sglang":
        return []
    fixed = cited.vocab_split("sglang", True, False)
    _, clears = vocab_replay(pool, vocab, hidden, fixed)
    rows = fixed.rows(vocab, tp)
    assert clears  # the fix, replayed
    return [DraftFinding(
        DraftDefect.LOADER_REFUSES, f"the draft's lm_head has draft_vocab_size {vocab}, padded to 64 only off CPU, "
        f"which does not split over TP {tp}: {s.name} on {where} does not start (\"{refused}\")",
        f"{split.pads_by_tp.source}; {cited.SGLANG_DIVIDE}",
        f"serve with sglang {cited.SGLANG_PADS_EVERYWHERE} or later, which pads it by 64 x TP on every platform "
        f"({rows} rows, {rows // tp} a rank: replayed on {tp} gloo ranks, the sharded logits equal the unsharded "
        f"draft's), or at a TP that divides {-(-vocab // 64) * 64}", "lm_head.weight", s.name)]


# --- 2. the embed_tokens verdict per rank ------------------------------------------------------------------------

def verdicts(pool: RankPool, target: torch.Tensor, draft: torch.Tensor, unanimous: bool) -> list[dict]:
    ids = torch.arange(target.shape[0])
    return on_ranks(pool, jobs.embed_verdicts, target=target, draft=draft, ids=ids, unanimous=unanimous)


def embed_verdict(pool: RankPool, draft: torch.Tensor | None, target: torch.Tensor | None, s: ServedLoader) \
        -> list[DraftFinding]:
    """vLLM's ranks disagreeing on whether the draft's embed_tokens is the target's, replayed on the pool's ranks."""
    tp = pool.world
    if s.line.engine != "vllm" or tp == 1 or draft is None or target is None or draft.shape != target.shape:
        return []
    draft, target = draft.float(), target.float()
    got = verdicts(pool, target, draft, unanimous=False)
    if len({r["verdict"] for r in got}) == 1:
        return []
    shares = [r for r, g in enumerate(got) if g["verdict"]]
    keeps = [r for r, g in enumerate(got) if not g["verdict"]]
    fixed = verdicts(pool, target, draft, unanimous=True)
    copied = verdicts(pool, target, target.clone(), unanimous=False)
    assert len({r["shares"] for r in fixed}) == 1 and all(r["verdict"] for r in copied)  # the fixes, replayed
    same = all(torch.equal(g["embeds"], fixed[0]["embeds"]) for g in got)
    effect = ("the rows every rank looks up are the same either way (each equal shard is the target's own): the "
              "draft's embeddings do not change; what differs is the module: a later write to the target's "
              "embed_tokens (a weight reload) reaches the draft on the sharing ranks only" if same else
              "the draft's embeddings differ from either unanimous choice")
    names = ", ".join(f"rank {r}: {'equal' if got[r]['verdict'] else 'distinct'}" for r in range(tp))
    return [DraftFinding(
        DraftDefect.EMBED_VERDICT,
        f"replayed on {tp} gloo ranks, each comparing its own vocab shard of embed_tokens with the target's "
        f"({names}): {_ranks(shares, 'shares', 'share')} the target's embed_tokens module, "
        f"{_ranks(keeps, 'keeps', 'keep')} the draft's own; {effect} "
        "(vllm issue #50158)",
        f"{cited.VLLM_VERDICT} _maybe_share_embeddings",
        f"copy the target's embed_tokens.weight into the draft (every rank then shares; replayed), or serve with "
        f"{cited.PR_50280} (every rank keeps the draft's; replayed)", "embed_tokens.weight", s.name)]


def _ranks(ranks: list[int], one: str, many: str) -> str:
    return f"rank {ranks[0]} {one}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} {many}"


# --- 3. SGLang's greedy verify -------------------------------------------------------------------------------------

def verify_branch(version: str) -> cited.VerifyBranch | None:
    """The eagle_sample interval `version` falls in (None: older than tpsim read it)."""
    key = version_key(cited.NEWEST_VERIFY if version == "latest" else version)
    found = [b for b in cited.VERIFY_BRANCHES if version_key(b.since) <= key]
    return found[-1] if found else None


def near_tie(tp: int, seed: int = 0, vocab: int = 64, hidden: int = 32):
    """(partials `[tp, k+1, H]` in bfloat16, lm_head `[V, H]`, drafts `[k]`): the row-parallel partial sums of the
    target's final hidden and a head with a near-tied pair of rows, drawn (the first of `seed`, `seed + 1`, ...)
    so that rank 0's and another rank's sums of the partials round to argmaxes that differ within the drafts;
    the drafts are rank 0's predictions, as a draft that proposes what rank 0's target predicts."""
    for s in range(seed, seed + 500):
        g = torch.Generator().manual_seed(s)
        partials = torch.randn(tp, VERIFY_STEPS + 1, hidden, generator=g).to(torch.bfloat16)
        head = torch.randn(vocab, hidden, generator=g)
        head[1] = head[0] + 1e-3 * torch.randn(hidden, generator=g)  # two tokens the target nearly ties
        predicts = [torch.argmax(torch.nn.functional.linear(jobs.rank_order_sum(partials, r).float(), head), -1)
                    for r in range(tp)]
        drafts = predicts[0][:VERIFY_STEPS]
        if len({jobs.accepted(drafts, p) for p in predicts}) > 1:
            return partials, head, drafts
    raise AssertionError(f"no near tie in 500 draws from seed {seed} at TP {tp}")


def verify_replay(pool: RankPool, broadcast: bool, seed: int = 0) -> list[dict]:
    partials, head, drafts = near_tie(pool.world, seed)
    return on_ranks(pool, jobs.greedy_verify, partials=partials, lm_head=head, drafts=drafts, broadcast=broadcast)


def verify_findings(pool: RankPool, s: ServedLoader, platform: Platform | None) -> list[DraftFinding]:
    """SGLang's greedy verify branch without a broadcast on `platform` at `tp`, replayed: each rank's count named."""
    tp = pool.world
    if s.line.engine != "sglang" or platform is None or tp == 1:
        return []
    version = s.name.partition("@")[2]
    branch = verify_branch(version)
    if branch is None:
        return [DraftFinding(DraftDefect.UNVERIFIED, f"{s.name} is older than {cited.OLDEST_VERIFY}, the oldest release "
                             "whose eagle_sample (speculative/eagle_utils.py) tpsim read: whether its greedy verify "
                             "broadcasts over TP is UNVERIFIED", f"{cited.SGLANG} {cited.EAGLE_UTILS}",
                             f"serve with sglang {cited.OLDEST_VERIFY} or later, or read that release's verify",
                             "verify", s.name)]
    greedy = platform in branch.greedy or platform is Platform.CUDA
    if not greedy or platform in branch.broadcast:
        return []
    when = "every verify" if platform is not Platform.CUDA else "a verify whose requests are all greedy"
    if tp == 2:  # a + b == b + a: the order of two partial sums changes no bit, so tpsim's replay cannot split them
        return [DraftFinding(
            DraftDefect.VERIFY_NO_BROADCAST, f"on {platform.value} {s.name} takes the greedy verify branch for {when} "
            "and does not broadcast the decision over TP: ranks whose target logits differ accept different counts "
            "and the next TP collective deadlocks (sglang issue #31071); read, not replayed: at TP 2 the sum of two "
            "partials is the same in either order (tpsim --tp 3 or more replays it)", str(branch.source),
            f"broadcast the verify decision from TP rank 0 ({cited.PR_31478})", "verify", s.name)]
    got = verify_replay(pool, broadcast=False)
    counts = got[0]["counts"]
    fixed = verify_replay(pool, broadcast=True)
    assert len(set(fixed[0]["counts"])) == 1  # the fix, replayed: every rank takes rank 0's count
    named = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    return [DraftFinding(
        DraftDefect.VERIFY_NO_BROADCAST,
        f"on {platform.value} {s.name} takes the greedy verify branch for {when} and does not broadcast the decision "
        f"over TP: replayed on {tp} gloo ranks whose target logits differ by the order each rank adds the TP partial "
        f"sums (a near-tied token), the ranks accept different counts of {VERIFY_STEPS} drafts ({named}); their "
        "seq_lens then differ and the next TP collective deadlocks (sglang issue #31071); tpsim gathered the counts "
        f"with a {TIMEOUT_S:g} s timeout before that collective",
        str(branch.source) + (f" ({branch.source.note})" if branch.source.note else ""),
        f"broadcast predict, accept_index and num_correct_drafts from TP rank 0 after the greedy verify, as "
        f"{cited.PR_31478} does (replayed: every rank accepts {fixed[0]['counts'][0]}); sglang 0.5.18 and later do it "
        "on ROCm only (PR #34238)", "verify", s.name)]
