"""`tpsim acceptance`'s measurement: the draft run on the capture it was trained on and on the capture the
engine serves (triage's two captures: ids as each program reads them, the served mode and strategy at the
served TP), over the target's greedy answers, reported as AL and per-position acceptance side by side
(tpsim.draft.acceptance says why one teacher-forced forward per capture is exact for greedy chain drafting)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tpsim.app.bounds import Cost, announce
from tpsim.app.prompts import Prompts, Sequence
from tpsim.app.draft_served import same_embedding, target_embedding
from tpsim.app.ranks import on_ranks
from tpsim.app.served_flags import flag_behaviour, served_as_eagle
from tpsim.app.triage import Captures, Inputs, captures
from tpsim.base.errors import UsageError
from tpsim.capture.positions import Position, PositionKind
from tpsim.config.loader import BUILTIN_CONFIGS
from tpsim.draft.acceptance import Acceptance, chains, greedy_prefix, paired, rounds
from tpsim.draft.checkpoint import DraftCheckpoint, build
from tpsim.draft.model import Eagle3Draft
from tpsim.modes import Mode, Strategy, TensorParallel
from tpsim.profiles.algorithm import eagle_served, fc_runs
from tpsim.profiles.loader_lines import lookup
from tpsim.profiles.profile import SpecAlgorithm
from tpsim.profiles.prefix import RADIX, served_in_order
from tpsim.run.acceptance import SequenceCapture, answers_job, captures_job, captures_many_job
from tpsim.run.spec import RunSpec

PROMPTS = BUILTIN_CONFIGS / "prompts"


@dataclass(frozen=True)
class Fed:
    """One capture the draft is fed: whose, which positions, in which mode and strategy, at which TP;
    `failure`: why the engine never feeds the draft this capture (nothing to measure)."""

    label: str
    positions: tuple[Position, ...]
    mode: Mode
    strategy: Strategy
    tp: int
    failure: str | None = None
    embedding: str = "the target's"  # whose embed_tokens the draft runs on, and why when not the target's
    cache: str = ""  # a radix cache that feeds the draft a stale KV, and where (empty: none)
    fc: bool = True  # the draft runs fc on it (False: SGLang's width test skips fc, tpsim.profiles.algorithm.FC_GATE)

    @property
    def text(self) -> str:
        where = ", ".join(map(str, self.positions)) or "nothing"
        embed = "" if self.embedding == "the target's" else f"; embed_tokens: {self.embedding}"
        cache = f"; {self.cache}" if self.cache else ""
        skipped = "" if self.fc else "; read past fc (its width test skips it)"
        return f"{where} at TP {self.tp}" + (f", mode {self.mode.name} ({self.strategy})" if self.tp > 1 else "") + \
            embed + cache + skipped


@dataclass(frozen=True)
class Measured:
    fed: Fed
    acceptance: Acceptance | None  # None: not measured (fed.failure says why)
    ranks_identical: bool = True
    rounds: tuple[tuple[int, ...], ...] = ()  # per sequence, each round's accepted draft tokens
    captures: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # per sequence, the capture the draft read

    def to_dict(self) -> dict:
        a = self.acceptance
        return {"label": self.fed.label, "positions": [str(p) for p in self.fed.positions], "tp": self.fed.tp,
                "mode": self.fed.mode.name, "capture_strategy": self.fed.strategy.value, "failure": self.fed.failure,
                "embedding": self.fed.embedding, "radix_cache": self.fed.cache or None, "fc": self.fed.fc,
                "ranks_identical": self.ranks_identical,
                "acceptance_length": None if a is None else round(a.length, 4),
                "per_position": None if a is None else [round(x, 4) for x in a.per_position],
                "rounds": None if a is None else a.rounds}


@dataclass
class AcceptanceReport:
    inputs: Inputs
    captures: Captures
    k: int
    sequences: list[Sequence]
    trained: Measured
    served: Measured
    notes: list[str] = field(default_factory=list)

    @property
    def difference(self) -> float | None:
        t, s = self.trained.acceptance, self.served.acceptance
        return None if t is None or s is None else s.length - t.length

    @property
    def noise(self) -> float | None:
        """Two standard errors of the AL difference, the two measured apart (rounds fall where each capture's
        acceptance puts them)."""
        t, s = self.trained.acceptance, self.served.acceptance
        return None if t is None or s is None else 2 * (t.stderr ** 2 + s.stderr ** 2) ** 0.5

    @property
    def paired(self) -> tuple[float, float] | None:
        """Served minus trained, tokens accepted per round, position by position over the same answers, and its
        standard error over sequences: the comparison the verdict rests on."""
        t, s = self.trained.acceptance, self.served.acceptance
        return None if t is None or s is None else paired(t, s)

    @property
    def kept(self) -> bool:
        """The served capture keeps the trained acceptance: the paired difference is not below two standard
        errors; False when the engine feeds the draft nothing."""
        if self.paired is None:
            return False
        mean, se = self.paired
        return not mean < -2 * se


def builtin_prompts(model: str) -> Path | None:
    path = PROMPTS / f"{model}.json"
    return path if path.is_file() else None


def seeded_prompts(vocab: int, n: int, length: int, new_tokens: int, seed: int) -> Prompts:
    g = torch.Generator().manual_seed(seed ^ 0xAC)
    return Prompts((), tuple(tuple(torch.randint(0, vocab, (length,), generator=g).tolist()) for _ in range(n)),
                   new_tokens, origin=f"{n} seeded random prompts of {length} tokens")


def trained_fed(caps: Captures) -> Fed:
    """The trained capture: the trainer's positions, the whole stream at TP 1."""
    return Fed("trained", tuple(caps.trained_positions), TensorParallel(), Strategy.MODEL_LEVEL, 1)


def served_fed(inputs: Inputs, caps: Captures, fc_width: int) -> Fed:
    """The served capture: the engine's positions, mode and strategy at the served TP (`failure` when it feeds the
    draft nothing)."""
    H = inputs.target.source.cfg.hidden_size
    embed = inputs.draft.raw.get("hidden_size") or H
    rep, got, mode, tp = caps.replay, caps.config, caps.mode, inputs.served.tp
    eagle = served_as_eagle(inputs.serve, inputs.served, inputs.draft.raw) \
        if inputs.served.algorithm is SpecAlgorithm.EAGLE else None
    if eagle is not None:  # no aux states: the engine hands the draft `final`, which it reads past fc or fails on
        held, shape = eagle
        fc = fc_runs(inputs.serve.engine, H, shape.hidden)
        failure = eagle_served(held.value, shape, held.server) if fc else None
        return Fed("served", (Position(PositionKind.FINAL),), mode.mode, mode.strategy, tp, failure, fc=fc)
    failure = got.failure if got.off else rep.failure
    if failure is None and not rep.positions:
        failure = f"{inputs.serve.name} captures nothing from these ids"
    n = len(rep.positions)
    fc = fc_runs(inputs.serve.engine, n * H, embed)
    if failure is None and fc and n * H != fc_width:  # the draft's own fc width, not the replay's count of ids
        failure = f"the capture is {n} x {H} = {n * H} wide where the draft's fc takes {fc_width}: the draft's fc fails on it"
    return Fed("served", tuple(rep.positions), mode.mode, mode.strategy, tp, failure, fc=fc)


@dataclass
class Prepared:
    """What every served capture is compared with: the sequences (kept where tpsim's target agrees they are
    greedy), the draft, and its acceptance on the capture it was trained on."""

    sequences: list[Sequence]
    draft: Eagle3Draft  # as trained: on the target's embedding
    trained: Measured
    k: int
    notes: list[str]
    checkpoint: DraftCheckpoint
    target_embed: torch.Tensor
    # served specs at TP 1 captured in the trained capture's forward, with their captures: kept only where every
    # sequence was kept whole (then each is bitwise what its own forward gives: captures_many_job)
    early: list[tuple[RunSpec, list[SequenceCapture]]] = field(default_factory=list)

    def captured(self, spec: RunSpec, tp: int) -> list[SequenceCapture] | None:
        """`spec`'s captures at `tp` taken along with the trained ones (a spec does not hold its TP)."""
        return next((c for s, c in self.early if s == spec), None) if tp == 1 else None


def prepare(inputs: Inputs, caps: Captures, draft: DraftCheckpoint, k: int, prompts: Prompts,
            cost: Cost | None = None, also: tuple[RunSpec, ...] = ()) -> Prepared | None:
    """The target's answers and the trained capture's acceptance (None on a torchrun rank other than 0); `cost`
    announced once the run is checked, before its first rank starts."""
    trained = trained_fed(caps)
    if len(trained.positions) * inputs.target.source.cfg.hidden_size != draft.config.capture_width:
        raise UsageError(f"training captured {len(trained.positions)} states ({', '.join(map(str, trained.positions))})"
                         f" and the draft's fc reads {draft.config.num_aux}; --train names what trained this draft")
    train_spec, _ = inputs.request.spec(inputs.target.source, trained.positions, (trained.mode, trained.strategy))
    announce(cost)
    notes: list[str] = []
    seqs = list(prompts.sequences)
    if prompts.to_answer:
        got = on_ranks(answers_job, train_spec, 1, prompts=[list(p) for p in prompts.to_answer],
                       new_tokens=prompts.new_tokens, stop=prompts.stop)
        if got is None:
            return None
        seqs += [Sequence(tuple(s), len(p)) for s, p in zip(got[0], prompts.to_answer)]
    also = tuple(a for a in also if a != train_spec)
    got = on_ranks(captures_many_job, train_spec, 1, tp=1, sequences=[list(q.tokens) for q in seqs],
                   specs=[train_spec, *also])
    if got is None:
        return None
    on_train, *extra = next(r for r in got.values() if r is not None)
    given = seqs
    seqs, on_train = _greedy(seqs, on_train, notes)
    whole = all(len(a.tokens) == len(b.tokens) for a, b in zip(seqs, given))
    early = list(zip((train_spec, *also), (on_train, *extra))) if whole else []
    embed = target_embedding(train_spec.source, train_spec.seed, train_spec.device).float()  # validated: present
    # as trained, on the target's embedding: SpecForge 0.2.0 loads it into the draft and freezes it
    # (specforge/algorithms/model_providers.py: load_embedding(target_model_path), freeze_embedding();
    # config/schema.py: load_target_embedding = True)
    model = build(draft, embed, train_spec.device).eval()
    return Prepared(seqs, model, _measure(model, trained, on_train, seqs, k), k, notes, draft, embed, early)


@dataclass(frozen=True)
class ServedPlan:
    """What one served configuration feeds the draft, before anything runs: the capture (`fed`; its failure when
    the engine feeds nothing), the spec that replays it, the embedding the draft runs on and the stale KV per
    sequence."""

    fed: Fed
    spec: RunSpec | None  # None: nothing to run (fed.failure)
    embed: torch.Tensor
    stale: list


def plan_served(prep: Prepared, inputs: Inputs, caps: Captures) -> ServedPlan:
    what = served_fed(inputs, caps, prep.draft.cfg.capture_width)
    embed, why = served_embedding(prep.checkpoint, inputs.request.ids.server or inputs.serve.name, prep.target_embed)
    stale, cache = stale_kv(inputs, prep.sequences)
    what = dataclasses.replace(what, embedding=why, cache=cache)
    return ServedPlan(what, served_spec(inputs, what), embed, stale)


def served_spec(inputs: Inputs, fed: Fed) -> RunSpec | None:
    """The spec that replays `fed` (None: the engine feeds nothing); UsageError where it cannot run."""
    if fed.failure is not None:
        return None
    return inputs.request.spec(inputs.target.source, fed.positions, (fed.mode, fed.strategy))[0]



def measure_served(prep: Prepared, plan: ServedPlan, on_serve: list[SequenceCapture] | None) -> Measured:
    """The draft's acceptance on `plan`'s capture (`on_serve`: its rows per sequence; None when it feeds nothing)."""
    if plan.spec is None or on_serve is None:
        return Measured(plan.fed, None)
    draft = prep.draft if plan.embed is prep.target_embed else build(prep.checkpoint, plan.embed,
                                                                      plan.spec.device).eval()
    return _measure(draft, plan.fed, on_serve, prep.sequences, prep.k, plan.stale)


def served(prep: Prepared, inputs: Inputs, caps: Captures) -> Measured | None:
    """The draft's acceptance on the capture `inputs`' engine serves, on the embedding its draft loader gives the
    draft (None on a torchrun rank other than 0)."""
    plan = plan_served(prep, inputs, caps)
    if plan.spec is None:
        return measure_served(prep, plan, None)
    on_serve = prep.captured(plan.spec, plan.fed.tp) or sequence_captures(plan.spec, plan.fed.tp, prep.sequences)
    return None if on_serve is None else measure_served(prep, plan, on_serve)


def stale_kv(inputs: Inputs, seqs: list[Sequence]) -> tuple[list, str]:
    """The sequences served in order with SGLang's radix cache on (tpsim.profiles.prefix.served_in_order): per
    sequence the draft KV a hit reuses stale, and what to call it (empty: none)."""
    held = flag_behaviour(RADIX, inputs.serve, inputs.served, inputs.served.radix_cache)
    if held is None:
        return [None] * len(seqs), ""
    stale = served_in_order(held.value, [(s.tokens, s.prompt) for s in seqs])
    hits = [s for s in stale if s is not None]
    if not hits:
        return stale, ""
    return stale, (f"radix cache ({held.server}: {held.value.value}): {len(hits)} of {len(seqs)} sequences reuse the "
                   f"previous one's first {hits[0][0] + 1} tokens, the draft's KV at position {hits[0][0]} computed "
                   "with its next token")


def served_embedding(ckpt: DraftCheckpoint, server: str, target: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The embedding `server`'s draft loader runs the draft on (tpsim.profiles.loaders: SGLang always the
    target's unless the config's widths differ; vLLM from 0.11.1 a draft's own when it differs), and what to call
    it."""
    own = ckpt.tensors.get("embed_tokens.weight")
    if own is None or same_embedding(own.to(target.dtype), target):
        return target, "the target's"
    try:
        loader = lookup(server.partition("+")[0]).loader
    except UsageError:
        loader = None
    if loader is None:
        return target, f"the target's (whether {server} keeps the draft's own is UNVERIFIED)"
    cfg = ckpt.config
    if not loader.embed.value.keeps_own(tuple(own.shape) == tuple(target.shape),
                                        cfg.target_hidden_size != cfg.hidden_size):
        return target, "the target's"
    return own, f"the draft's own, not the target's ({server} keeps it: {loader.embed.source})"


def measure(inputs: Inputs, draft: DraftCheckpoint, k: int, prompts: Prompts, cost: Cost | None = None,
            as_served: Inputs | None = None, caps: Captures | None = None) -> AcceptanceReport | None:
    """AL trained vs served (None on a torchrun rank other than 0); `as_served`: the inputs the engine serves from
    where they differ from training's (the draft config's ids rewritten), else `inputs`; `caps`: their capture,
    where the caller has read it already."""
    as_served = as_served or inputs
    caps = caps or captures(as_served)
    fed = served_fed(as_served, caps, draft.config.capture_width)
    spec = served_spec(as_served, fed)
    also = (spec,) if spec is not None and fed.tp == 1 else ()  # taken along by the trained capture's forward
    prep = prepare(inputs, captures(inputs), draft, k, prompts, cost, also)
    on_serve = None if prep is None else served(prep, as_served, caps)
    if on_serve is None:
        return None
    return AcceptanceReport(as_served, caps, k, prep.sequences, prep.trained, on_serve, prep.notes)


def sequence_captures(spec: RunSpec, tp: int, seqs: list[Sequence]) -> list[SequenceCapture] | None:
    got = on_ranks(captures_job, spec, tp, tp=tp, sequences=[list(s.tokens) for s in seqs])
    return None if got is None else next(r for r in got.values() if r is not None)


def _greedy(seqs: list[Sequence], caps: list[SequenceCapture], notes: list[str]):
    """Each sequence up to where tpsim's target stops agreeing that its answer is the greedy one (an answer made
    elsewhere, or a near-tie that rounding flips)."""
    kept, kept_caps = [], []
    for s, c in zip(seqs, caps):
        n = greedy_prefix(list(s.tokens), c.argmax, s.prompt)
        if n < len(s.tokens):
            notes.append(f"sequence {len(kept) + 1}: tpsim's target disagrees with the given answer at token {n} of "
                         f"{len(s.tokens)}: measured up to there")
        kept.append(Sequence(s.tokens[:n], s.prompt, s.text))
        kept_caps.append(SequenceCapture(c.capture[:n], c.identical, c.argmax[:n]))
    return kept, kept_caps


def _measure(model, what: Fed, caps: list[SequenceCapture], seqs: list[Sequence], k: int,
             stale: list | None = None) -> Measured:
    if any(c.capture.shape[0] < len(s.tokens) for c, s in zip(caps, seqs)):
        c, s = next((c, s) for c, s in zip(caps, seqs) if c.capture.shape[0] < len(s.tokens))
        return Measured(Fed(what.label, what.positions, what.mode, what.strategy, what.tp,
                            f"rank 0 holds {c.capture.shape[0]} of the {len(s.tokens)} tokens' rows: what the engine "
                            "feeds the draft then is not replayed"), None)
    each = []
    dev, threads = model.d2t.device, torch.get_num_threads()
    if dev.type == "cpu":  # as each rank runs (tpsim.parallel.pool): on 2 busy cores, 2 threads ran 4x slower
        torch.set_num_threads(1)
    try:
        for c, s, reused in zip(caps, seqs, stale or [None] * len(seqs)):
            toks = torch.tensor(s.tokens, device=dev)
            cap = c.capture[:len(s.tokens)].to(dev, torch.float32)
            each.append(rounds(chains(model, cap, toks, k, reused, what.fc).cpu(), list(s.tokens), s.prompt))
    finally:
        torch.set_num_threads(threads)
    total = sum(each, Acceptance(k, ()))
    if not total.rounds:  # an AL over no round is nan, and nan compares as "kept": no measurement at all
        return Measured(dataclasses.replace(what, failure=_no_round(k, seqs)), None)
    return Measured(what, total, all(c.identical for c in caps),
                    tuple(a.accepted for a in each), tuple(c.capture[:len(s.tokens)] for c, s in zip(caps, seqs)))


def _no_round(k: int, seqs: list[Sequence]) -> str:
    longest = max((s.answer for s in seqs), default=0)
    return (f"no verify round: k = {k} draft tokens need an answer of at least {k + 1} tokens, and the "
            f"longest kept is {longest} (a note says where tpsim's target stopped agreeing with a given answer)")


@dataclass
class TriageMeasure:
    """`triage --measure`: the draft's acceptance as trained, as served, and with each replayed fix applied."""

    trained: Measured
    served: Measured
    fixed: dict[int, Measured]  # finding index -> the served capture's acceptance once its fix is applied
    sequences: int
    notes: list[str]


def measure_triage(t, draft: DraftCheckpoint, k: int, prompts: Prompts,
                   cost: Cost | None = None) -> TriageMeasure | None:
    """For a triage `t` (tpsim.app.triage.Triage, its fixes replayed): None on a torchrun rank other than 0."""
    caps = captures(t.inputs)
    prep = prepare(t.inputs, caps, draft, k, prompts, cost)
    on_serve = None if prep is None else served(prep, t.inputs, caps)
    if on_serve is None:
        return None
    fixed = {}
    for i, remedy in t.fixes.items():
        if t.findings[i].replayed:
            changed = remedy.apply(t.inputs)
            got = served(prep, changed, captures(changed))
            if got is None:
                return None
            fixed[i] = got
    return TriageMeasure(prep.trained, on_serve, fixed, len(prep.sequences), prep.notes)
