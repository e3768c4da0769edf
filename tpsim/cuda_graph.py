"""CUDA graphs for small batches: one forward with EAGLE-3 capture, captured once, replayed.

At 1-64 tokens (decode, target verify: where the ar-fusion capture bug lives) a forward is
bound by kernel launches and Python, not by the GPU. A graph replays the recorded kernels
with one launch. The forward has no host sync (tests/test_gpu.py checks), so it can be
captured; token count and capture positions are fixed per graph, as in an engine's graph
runner (one graph per batch size).
"""

from __future__ import annotations

import torch

from tpsim.capture import Position, Recorder


class GraphedForward:
    """`model` (TP=1, or NCCL groups: gloo collectives cannot be captured) forward of
    `num_tokens` tokens with capture of `positions`, as a CUDA graph.

    `g(ids)` copies ids `[num_tokens]` (int64, on the model's GPU) into the graph's input and
    replays it; it returns (capture `[T, len(positions) * hidden]`, logits `[T, vocab]`), tensors
    owned by the graph and overwritten by the next replay (clone to keep them).
    """

    def __init__(self, model, num_tokens: int, positions: list[Position], strategy: str = "model-level",
                 warmup: int = 3):
        device = model.group.device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if model.group.size > 1 and model.group.pg is not None and \
                torch.distributed.get_backend(model.group.pg) != "nccl":
            raise ValueError("a graph cannot capture gloo collectives: use TP=1 or NCCL")
        self.model, self.positions, self.strategy = model, list(positions), strategy
        self.ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph requires
            for _ in range(warmup):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.capture, self.logits = self._forward()

    def _forward(self):
        recorder = Recorder(self.positions, self.strategy)
        with self.model.probe.attach(recorder):
            logits = self.model(self.ids)
        return (recorder.concat() if self.positions else logits.new_zeros((self.ids.shape[0], 0))), logits

    def __call__(self, ids: torch.Tensor):
        self.ids.copy_(ids)
        self.graph.replay()
        return self.capture, self.logits
