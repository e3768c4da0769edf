"""Token pairing: the capture of position t goes with the embedding of token t+1, and the last row with
the token the target just sampled (vLLM proposer: "Shift the input ids by one token. [a1, b1, b2, c1, c2,
c3] -> [b1, b2, c1, c2, c3, c3]" then the last slot set; EAGLE `topK_genrate`: `input_ids[:, 1:]`)."""

from __future__ import annotations

import torch


def pair(ids: torch.Tensor, next_token: int | torch.Tensor) -> torch.Tensor:
    """`ids` `[T]` the tokens the target read → `[T]` the tokens the draft reads beside the same capture rows."""
    nxt = torch.as_tensor(next_token, dtype=ids.dtype, device=ids.device).reshape(1)
    return torch.cat([ids[1:], nxt])
