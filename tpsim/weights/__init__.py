"""Weights: seeded per HF tensor name (seeded), Hub checkpoints read per rank (reader, fp8, mxfp4), export."""
