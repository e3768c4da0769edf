"""PD disaggregation's hand-off on real ranks: ranks 0..P-1 are the prefill server's TP group, ranks
P..P+D-1 the decode server's. The prefill group runs the target over the prompt and captures the aux
states at the served positions (as `check` does); its rank 0 takes the last token's state the version
transfers (tpsim.profiles.pd), copies it into its buffer of the width the version allocates (SGLang's
MetadataBuffers.set_buf), and sends that buffer to every decode rank, which receives it into a buffer
of the same width. Not modelled: the KV transfer, the bootstrap server, the buffers' other fields."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpsim.draft.attention import DraftCache
from tpsim.draft.config import DraftConfig
from tpsim.draft.model import Eagle3Draft
from tpsim.draft.pairing import pair
from tpsim.draft.weights import specs
from tpsim.parallel.group import TPGroup
from tpsim.parallel.launch import RankContext
from tpsim.parallel.ops import Op
from tpsim.profiles.pd import PdTransfer, Widths
from tpsim.run.jobs import run_captured_parts, spec_model
from tpsim.run.spec import RunSpec

OK, FAILED = 1, 0  # the transfer's status, sent first (SGLang's decode side polls the sender's KVPoll)


@dataclass(frozen=True)
class Disaggregation:
    """`--disaggregate P:D`: the two servers' TP sizes, the hand-off the version does, the widths."""

    prefill: int
    decode: int
    transfer: PdTransfer
    widths: Widths
    why: str = ""  # the version and the source that decide the hand-off

    @property
    def world(self) -> int:
        return self.prefill + self.decode

    @property
    def buffer(self) -> int:
        return self.transfer.buffer(self.widths)


@dataclass(frozen=True)
class PdRank:
    """One rank's part: `sent` on the prefill group's rank 0 (its buffer; None when the copy into it
    failed, `failure` holding torch's words), `received` on a decode rank (None: nothing was sent)."""

    rank: int
    prefill: bool
    sent: torch.Tensor | None = None
    received: torch.Tensor | None = None
    failure: str = ""
    collectives: tuple[tuple[Op, str, int], ...] = ()


def pd_job(ctx: RankContext, spec: RunSpec, pd: Disaggregation) -> PdRank | None:
    group = ctx.blocks((pd.prefill, pd.decode))
    if group is None:  # a pool rank past the two servers
        return None
    group.tracer.clear()
    out = _prefill(ctx, spec, pd, group) if ctx.rank < pd.prefill else _decode(ctx, pd, group)
    return PdRank(**{**out.__dict__, "collectives": tuple((r.op, r.caller, r.bytes) for r in group.tracer.records)})


def _prefill(ctx: RankContext, spec: RunSpec, pd: Disaggregation, group: TPGroup) -> PdRank:
    ctx.progress(f"prefill TP={pd.prefill}: the target's forward")
    model = spec_model(spec, group)
    parts, logits = run_captured_parts(model, list(spec.tokens), list(spec.positions))
    if group.rank != 0:
        return PdRank(ctx.rank, True)
    state = handed_state(spec, pd, torch.cat(parts, dim=-1), int(logits[-1].argmax()))
    buffer = torch.zeros(pd.buffer, dtype=state.dtype)
    try:  # MetadataBuffers.set_buf: output_hidden_states[idx].copy_(req.hidden_states_tensor)
        buffer.copy_(state)
        failure = ""
    except RuntimeError as e:
        failure = str(e).splitlines()[0]
    for d in range(pd.prefill, pd.world):
        group.send(torch.tensor([FAILED if failure else OK]), d, "pd.status")
        if not failure:
            group.send(buffer, d, "pd.hidden_states")
    return PdRank(ctx.rank, True, None if failure else buffer, failure=failure)


def _decode(ctx: RankContext, pd: Disaggregation, group: TPGroup) -> PdRank:
    status = group.recv((1,), torch.long, 0, "pd.status")
    if int(status) != OK:
        return PdRank(ctx.rank, False)
    return PdRank(ctx.rank, False, received=group.recv((pd.buffer,), torch.float32, 0, "pd.hidden_states"))


def handed_state(spec: RunSpec, pd: Disaggregation, capture: torch.Tensor, sampled: int) -> torch.Tensor:
    """The last token's state the version transfers: the target's aux states as captured, or the draft's
    hidden state after its extend (a seeded EAGLE-3 draft of H_draft run on the capture, fc at step 0)."""
    if pd.transfer is PdTransfer.TARGET_AUX:
        return capture[-1].float().cpu()
    draft = seeded_draft(spec, pd.widths)
    tokens = pair(torch.tensor(spec.tokens, dtype=torch.long), sampled)
    with torch.no_grad():
        step = draft.first(capture.float().cpu(), tokens, torch.arange(len(spec.tokens)), DraftCache())
    return step.hidden[-1]


def seeded_draft(spec: RunSpec, w: Widths) -> Eagle3Draft:
    """An EAGLE-3 draft H_draft wide for this target, its weights drawn from the run's seed."""
    heads = 2 if w.draft % 4 == 0 else 1
    cfg = DraftConfig(hidden_size=w.draft, intermediate_size=2 * w.draft, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=w.draft // heads, vocab_size=spec.cfg.vocab_size,
                      draft_vocab_size=spec.cfg.vocab_size, target_hidden_size=w.target, num_aux=w.num_aux)
    g = torch.Generator().manual_seed(spec.seed)
    model = Eagle3Draft(cfg)
    for s in specs(model).values():
        s.load(torch.randn(s.shape, generator=g) / 4)
    return model
