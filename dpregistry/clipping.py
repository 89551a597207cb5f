"""Per-example clipping that every privatizer shares (works in every space)."""

from __future__ import annotations

import math

import torch

from .stages import ClippedSum


def clip_weights(norms: torch.Tensor, clip: float, finite: torch.Tensor) -> torch.Tensor:
    """min(1, C/‖c_i‖), and 0 for examples whose norm or loss is not finite.

    A NaN/inf example is dropped before clipping, so it can never carry more than the clip.
    """
    w = (clip / norms).clamp(max=1.0) if math.isfinite(clip) else torch.ones_like(norms)
    return torch.where(finite, w, torch.zeros_like(w))


def clip_and_sum(contribution, clip: float) -> ClippedSum:
    """Σ_i min(1, C/‖c_i‖)·c_i over the finite examples, with counts for logging."""
    norms = contribution.norms()
    finite = torch.isfinite(norms)
    losses = contribution.losses
    if losses is not None and losses.numel():
        finite &= torch.isfinite(losses.to(norms.device))
    w = clip_weights(norms, clip, finite)
    agg = contribution.weighted_sum(w)
    loss_sum = float(losses[finite.to(losses.device)].sum()) if losses is not None and losses.numel() else 0.0
    return ClippedSum(agg, count=int(norms.numel()), clipped=int((finite & (norms > clip)).sum()),
                      nonfinite=int((~finite).sum()), loss_sum=loss_sum, kind=contribution.kind)
