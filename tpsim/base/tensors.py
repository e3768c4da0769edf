"""Tensor facts every layer states the same way: how many NaN and Inf values a tensor holds, in the words every
refusal and failure of non-finite data uses (a diagnose reference, a rank dump, a draft's weights), and whether two
tensors hold the same bits."""

from __future__ import annotations

import torch


def nonfinite(t: torch.Tensor) -> str:
    """'' when every value of `t` is finite (an integer or bool tensor always is), else `N NaN and M Inf of K
    values`."""
    if not (t.is_floating_point() or t.is_complex()):
        return ""
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} Inf of {t.numel()} values" if nan or inf else ""


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so a NaN equals the same NaN, unlike torch.equal)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
