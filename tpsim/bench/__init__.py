"""Benchmark helpers: transformers reference model (hf), FLOP formulas (flops), rank jobs (jobs), TP table (scaling)."""
