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
    """Σ_i min(1, C/‖c_i‖)·c_i over the finite examples, with counts for logging; in a user-level
    run (``contribution.groups``), over the users: Σ_u min(1, C/‖m_u‖)·m_u with m_u the mean of
    the user's rows."""
    if contribution.groups is not None:
        return _clip_groups(contribution, clip)
    norms = contribution.norms()
    finite = torch.isfinite(norms)
    losses = contribution.losses
    if losses is not None and losses.numel():
        finite &= torch.isfinite(losses.to(norms.device))
    w = clip_weights(norms, clip, finite)
    agg = contribution.weighted_sum(w)
    return ClippedSum(agg, count=int(norms.numel()), clipped=int((finite & (norms > clip)).sum()),
                      nonfinite=int((~finite).sum()), loss_sum=_loss_sum(losses, finite), kind=contribution.kind)


def _clip_groups(contribution, clip: float) -> ClippedSum:
    """Each user's rows are one unit: their mean, clipped to C as one vector (ULS, Charles et al.
    2024), so a user moves the clipped sum by at most C whatever their data. A user any of whose
    rows is not finite is dropped whole."""
    users, local = torch.unique(contribution.groups, return_inverse=True)
    n = len(users)
    formed = contribution.grouped(local, n)  # each user's sum, released as its norm measured it
    sums = formed.norms() if formed is not None else contribution.group_norms(local, n)
    local = local.to(sums.device)
    rows = torch.bincount(local, minlength=n).to(sums.dtype)
    bad = torch.zeros(n, dtype=sums.dtype, device=sums.device)
    losses = contribution.losses
    if losses is not None and losses.numel():
        bad.index_add_(0, local, (~torch.isfinite(losses.to(sums.device))).to(sums.dtype))
    finite = torch.isfinite(sums) & (bad == 0)
    means = sums / rows
    w = clip_weights(means, clip, finite) / rows          # per user: min(1, C/‖mean‖) / m_u
    agg = formed.weighted_sum(w) if formed is not None else contribution.weighted_sum(w[local])
    loss_sum = 0.0
    if losses is not None and losses.numel():
        per_user = torch.zeros(n, dtype=torch.float64, device=sums.device).index_add_(
            0, local, losses.to(sums.device, torch.float64).nan_to_num(0.0, 0.0, 0.0))
        loss_sum = float((per_user / rows.double())[finite].sum())
    return ClippedSum(agg, count=n, clipped=int((finite & (means > clip)).sum()), nonfinite=int((~finite).sum()),
                      loss_sum=loss_sum, kind=contribution.kind)


def clip_and_sum_per_layer(contribution, clip: float) -> ClippedSum:
    """Per-layer clipping: each layer's per-example gradient clipped to C/√G (G layers, tied ones
    merged), summed as the backward reaches it (``HookContribution.clipped_sum_per_layer``). Every
    example still moves the sum by at most C, so the noise is that of flat clipping at C. The
    run checked before step 1 that the estimator's contributions allow it (``LayerGradients``)."""
    if contribution.batch_size == 0:  # an empty Poisson batch: the zero sum
        return clip_and_sum(contribution, clip)
    if contribution.groups is not None:
        raise RuntimeError("per-layer clipping does not clip groups of rows")
    agg, clipped, dropped = contribution.clipped_sum_per_layer(clip)
    return ClippedSum(agg, count=int(contribution.n), clipped=int(clipped.sum()), nonfinite=int(dropped.sum()),
                      loss_sum=_loss_sum(contribution.losses, ~dropped), kind=contribution.kind)


def _loss_sum(losses, keep: torch.Tensor) -> float:
    """The losses of the examples that count (for the step's mean loss)."""
    if losses is None or not losses.numel():
        return 0.0
    return float(losses[keep.to(losses.device)].sum())
