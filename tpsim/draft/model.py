"""The EAGLE-3 draft forward as the engines run it (research doc §2.3).

Step 0 takes the target's capture `[T, num_aux*Ht]` (optionally normed: `input_norm` or `fc_norm`) through
`fc` to H; a later step takes the draft's own pre-final-norm hidden, H wide, and skips fc: SGLang
`python/sglang/srt/models/llama_eagle3.py` returns `hidden_states_to_aux` ("For draft decode, we capture the
hidden state before norm"; the file the research doc reads at commit 03d5a777), vLLM returns
`(hidden_states, hidden_prenorm)` (PR #16937: "the pre-normalization value can be passed into the next
iteration"), SpecForge's TTT loop sets `hidden_states = hidden_states_out` (`specforge/algorithms/eagle3/
model.py`, research doc §2.3 step 6). EAGLE-3.1 drafts (`norm_output: true`) feed back the normed hidden
instead: SpecForge PR #879 ("Eagle3's next hidden states are un-normalised ... Eagle3.1's next hidden states
are normalised"; it links SGLang `llama_eagle3.py` @9d18277c, `norm_output` default False), speculators
PR #610 (`--norm-output`: "Feed post-norm hidden states back across TTT steps"). Logits are over the draft
vocab Vd; target id = i + d2t[i]."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tpsim.draft.attention import DraftCache
from tpsim.draft.config import DraftConfig
from tpsim.draft.layer import DraftLayer
from tpsim.layers.embedding import VocabParallelEmbedding
from tpsim.layers.linear import ReplicatedLinear
from tpsim.layers.norm import RMSNorm
from tpsim.parallel.group import TPGroup


@dataclass(frozen=True)
class DraftStep:
    """One draft step over T rows: `hidden` `[T, H]` what the next step is fed (pre-final-norm; normed under
    `norm_output`), `logits`
    `[T, Vd]` over the draft vocab, `positions` `[T]` this step's."""

    hidden: torch.Tensor
    logits: torch.Tensor
    positions: torch.Tensor


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig, group: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        group = group or TPGroup()
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, group, "embed_tokens", dtype)
        self.input_norm = (RMSNorm(cfg.capture_width, cfg.rms_norm_eps, group, "input_norm", dtype)
                           if cfg.norm_before_fc else None)
        self.fc_norm = nn.ModuleList(
            RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, group, f"fc_norm.{i}", dtype)
            for i in range(cfg.num_aux)) if cfg.fc_norm else None
        self.fc = ReplicatedLinear(cfg.capture_width, h, group, "fc", dtype)
        self.midlayer = DraftLayer(cfg, group, "midlayer", dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, group, "norm", dtype)
        self.lm_head = ReplicatedLinear(h, cfg.draft_vocab_size, group, "lm_head", dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=group.device))

    def project(self, capture: torch.Tensor, fc: bool = True) -> torch.Tensor:
        """`[T, num_aux*Ht]` → `[T, H]`: step 0's hidden. `fc` False: the capture passes unprojected, as wide as the
        embedding (SGLang's width test, tpsim.profiles.algorithm.FC_GATE: llama_eagle3.py runs fc only `if
        hidden_states.shape[-1] != embeds.shape[-1]`)."""
        if not fc:
            if capture.shape[-1] != self.cfg.hidden_size:
                raise ValueError(f"an unprojected capture must be {self.cfg.hidden_size} wide, not {capture.shape[-1]}")
            return capture
        if self.input_norm is not None:
            capture = self.input_norm(capture)
        if self.fc_norm is not None:
            chunks = capture.chunk(len(self.fc_norm), dim=-1)
            capture = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(capture)

    def _run(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: DraftCache) -> DraftStep:
        out = self.midlayer(positions, self.embed_tokens(tokens), hidden, cache)
        normed = self.norm(out)
        return DraftStep(normed if self.cfg.norm_output else out, self.lm_head(normed), positions)

    def first(self, capture: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              cache: DraftCache, fc: bool = True) -> DraftStep:
        """Step 0: capture row t with `tokens[t]`, already paired (`pairing.pair`: token t+1); `fc`: as `project`."""
        return self._run(self.project(capture, fc), tokens, positions, cache)

    def next(self, prev: DraftStep, tokens: torch.Tensor, cache: DraftCache) -> DraftStep:
        """Step s > 0: row i fed its own previous pre-norm hidden (fc skipped) and `tokens[i]`, the token
        the previous step proposed for that row; one position further on."""
        return self._run(prev.hidden, tokens, prev.positions + 1, cache)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`[T, Vd]` → `[T, V]`, −inf outside the draft vocab (vLLM's scatter)."""
        full = logits.new_full((logits.shape[0], self.cfg.vocab_size), float("-inf"))
        idx = self.to_target(torch.arange(logits.shape[-1], device=logits.device))
        return full.index_copy(1, idx, logits)

    def proposals(self, step: DraftStep) -> torch.Tensor:
        """Greedy proposals in target ids `[T]`."""
        return self.to_target(step.logits.argmax(dim=-1))
