"""Hugging Face checkpoints: read them sharded per rank (`reader`), dequantize block FP8
(`fp8`), and write tpsim's seeded models as checkpoints (`export`)."""

from tpsim.checkpoint.reader import Checkpoint, expected_tensors, load_weights, validate

__all__ = ["Checkpoint", "expected_tensors", "load_weights", "validate"]
