"""The decoder (decoder) and its two-batch overlap (overlap)."""
