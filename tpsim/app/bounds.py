"""What an acceptance measurement may cost, decided before any rank starts: --steps and --new-tokens as counts
(`check_count`), k against the answers (`check_rounds`: one verify round at least), and the run's `Cost` by
formula (forwards, FLOPs, the largest activation one forward holds), refused past the memory free or MAX_RUN_S
without --ignore-limits, and announced on stderr before a run estimated past ANNOUNCE_S."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from tpsim.app.preflight import IGNORE_LIMITS, available_memory
from tpsim.app.prompts import Prompts
from tpsim.app.request import MAX_TOKENS, RunRequest
from tpsim.base.environ import is_reporting_process
from tpsim.base.errors import UsageError
from tpsim.base.ui import human_bytes
from tpsim.bench.flops import forward_flops
from tpsim.config.model import ModelConfig
from tpsim.draft.acceptance import has_round
from tpsim.draft.config import DraftConfig
from tpsim.run.jobs import DTYPES


# Seconds per forward (Python and launch overhead) and FLOP/s, fitted loosely on a loaded 2-core CPU (30-120 ms a
# forward of tiny, ~20 GFLOP/s on smollm2-135m): an estimate within a few times, not a timing.
RATES = {"cpu": (0.05, 1e10), "cuda": (0.05, 1e13)}
ANNOUNCE_S = 60  # a run estimated longer says so before it starts
MAX_RUN_S = 30 * 60  # a run estimated longer is refused without --ignore-limits
PASSES = 2  # captures the draft runs on: as trained and as served (triage adds one per replayed fix)


def check_count(value, option: str) -> None:
    """A count a typed request holds (--steps, --new-tokens): an integer from 1 to MAX_TOKENS, past which no
    target's context reaches."""
    if type(value) is not int:  # a bool is an int subclass, not a count
        raise UsageError(f"{option} {value!r} is not an integer; give a whole number")
    if not 1 <= value <= MAX_TOKENS:
        raise UsageError(f"{option} {value} must be from 1 to {MAX_TOKENS} (past that no target's context reaches)")


def check_rounds(prompts: Prompts, k: int) -> None:
    """Refuse a k no answer gives a verify round: an AL over no round is no measurement."""
    longest = max([s.answer for s in prompts.sequences] + [prompts.new_tokens] * bool(prompts.to_answer))
    if has_round(longest, k):
        return
    fix = f"--steps {longest - 1} or fewer" if longest > 1 else "longer answers"
    if prompts.to_answer:
        fix += f", or --new-tokens {k + 1} or more"
    raise UsageError(f"--steps {k} drafts {k} tokens per verify round, which needs an answer of at least {k + 1} "
                     f"tokens, and the longest answer of {prompts.origin} is {longest}; give {fix}")


@dataclass(frozen=True)
class Cost:
    """A measurement by formula: `forwards` the target's forwards and the draft's steps, `flops` theirs, `peak` the
    bytes the largest one holds at once on a rank (the longest sequence's logits or attention scores)."""

    forwards: int
    flops: float
    peak: int
    device: str

    @property
    def seconds(self) -> float:
        overhead, rate = RATES[self.device]
        return self.forwards * overhead + self.flops / rate

    @property
    def line(self) -> str:
        s = self.seconds
        took = f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.0f} h"
        return (f"estimated cost: {self.forwards} forwards, {self.flops / 1e12:.1f} TFLOP, about {took} on this "
                f"machine's {self.device}")


def estimate(cfg: ModelConfig, draft: DraftConfig, prompts: Prompts, k: int, device: str, dtype: str,
             passes: int = PASSES) -> Cost:
    """Each answer token answered here a full forward over all before it (tpsim's decoder has no KV cache); per
    capture pass (the trained one and one per served configuration), each sequence one forward and k draft steps
    over its rows."""
    new = prompts.new_tokens
    lengths = [len(s.tokens) for s in prompts.sequences] + [len(p) + new for p in prompts.to_answer]
    tokens, squares = passes * sum(lengths), passes * sum(S * S for S in lengths)
    for p in prompts.to_answer:
        t, sq = _span(len(p), len(p) + new - 1)
        tokens, squares = tokens + t, squares + sq
    per = forward_flops(cfg, 1)  # linear in T and in T^2: per token, per query-key pair
    flops = tokens * per["matmul"] + squares * per["attention"] + \
        passes * sum(_draft_flops(draft, S - 1, k) for S in lengths)
    forwards = new * len(prompts.to_answer) + passes * len(lengths) * (1 + k)
    return Cost(forwards, flops, _peak(cfg, draft, max(lengths), k, DTYPES[dtype].itemsize), device)


def _span(a: int, b: int) -> tuple[int, int]:
    """(sum of T, sum of T^2) for T = a..b."""
    def upto(n: int) -> tuple[int, int]:
        return n * (n + 1) // 2, n * (n + 1) * (2 * n + 1) // 6
    (t1, q1), (t0, q0) = upto(b), upto(a - 1)
    return t1 - t0, q1 - q0


def _draft_flops(d: DraftConfig, rows: int, k: int) -> int:
    """k steps over `rows` rows: fc, one decoder layer and the head per row and step; step j's attention reads
    j + 1 blocks of keys (tpsim.draft.attention: the whole masked product is computed)."""
    H, hd, heads = d.hidden_size, d.head_dim, d.num_attention_heads
    params = d.num_aux * d.target_hidden_size * H + 2 * H * (heads + 2 * d.num_key_value_heads) * hd + \
        heads * hd * H + 3 * H * d.intermediate_size + H * d.draft_vocab_size
    return 2 * params * rows * k + 2 * heads * hd * rows * rows * k * (k + 1)


def _peak(cfg: ModelConfig, d: DraftConfig, S: int, k: int, itemsize: int) -> int:
    logits = S * cfg.vocab_size * itemsize
    attention = cfg.num_attention_heads * S * S * itemsize
    draft = d.num_attention_heads * S * S * (k + 1) * 4 + S * S * (k + 1)  # float32 scores and the bool mask
    return max(logits, attention, draft)


def check_cost(cost: Cost, ignore_limits: bool, ranks: int) -> None:
    """Refuse a run whose largest forward does not fit the memory free (each CPU rank holds its own) or that is
    estimated past MAX_RUN_S, unless --ignore-limits."""
    if ignore_limits:
        return
    _check_activations(cost, ranks)
    if cost.seconds > MAX_RUN_S:
        raise UsageError(f"{cost.line}, past the {MAX_RUN_S // 60}-minute bound; fewer or shorter prompts, a "
                         f"smaller --new-tokens or --steps, or {IGNORE_LIMITS}")


def _check_activations(cost: Cost, ranks: int) -> None:
    if cost.device == "cpu" and not os.path.exists("/proc/meminfo"):
        return
    if cost.device == "cuda" and not torch.cuda.is_available():  # the run's own checks refuse it in one line
        return
    need = cost.peak * (ranks if cost.device == "cpu" else 1)
    have, where = available_memory(cost.device)
    if need > have:
        raise UsageError(f"the longest sequence's logits or attention need {human_bytes(need)} at once and there "
                         f"is {human_bytes(have)} {where}; shorter prompts or answers, fewer --steps, or "
                         f"{IGNORE_LIMITS}")


def checked_cost(prompts: Prompts, k: int, cfg: ModelConfig, draft: DraftConfig, run: RunRequest, tp: int,
                 passes: int = PASSES) -> Cost:
    """k held to the answers and the run to the bounds, before any rank starts: the cost to announce."""
    check_rounds(prompts, k)
    cost = estimate(cfg, draft, prompts, k, run.device, run.run_dtype, passes)
    check_cost(cost, run.ignore_limits, tp)
    return cost


def announce(cost: Cost | None) -> None:
    """The estimate on stderr, as the progress lines are, before a run estimated past ANNOUNCE_S."""
    if cost is not None and cost.seconds > ANNOUNCE_S and is_reporting_process():
        print(f"tpsim: {cost.line}", file=sys.stderr, flush=True)
