"""Empirical privacy auditing: a statistical lower bound on ε from runs on neighbouring data.

A mechanism M is run many times on two neighbouring data sets D and D'. A threshold test on one
released statistic tries to tell them apart. (ε, δ)-DP bounds every test (Kairouz et al. 2015):

    FPR + e^ε·FNR >= 1 − δ   and   FNR + e^ε·FPR >= 1 − δ,

so Clopper–Pearson upper bounds on the two error rates give a lower bound on ε that holds with
the stated confidence (the method of Jagielski et al. 2020 and Nasr et al. 2021). The threshold is
chosen on one half of the runs and the rates are counted on the other half, so choosing it does
not bias the bound. A correct implementation never lets this lower bound exceed the ε its
accountant claims; a broken one (noise too small, sensitivity too large) is caught once the
bound does.

Many releases at once: :func:`trial_sums` stacks the clipped sums of many trials along a leading
axis, so one call of a privatizer's own ``release`` (independent noise on every coordinate) makes
all of them, and :func:`projections` reads one statistic per trial from the stacked release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy import stats

from .spaces import Aggregate
from .stages import ClippedSum


def clopper_pearson_upper(k, n: int, alpha: float):
    """One-sided (1 − alpha) upper confidence bound on a binomial rate with k successes in n
    (elementwise for an array of k)."""
    k = np.asarray(k)
    out = np.ones(k.shape, dtype=float)
    m = k < n
    out[m] = stats.beta.ppf(1 - alpha, k[m] + 1, n - k[m])
    return float(out) if out.ndim == 0 else out


@dataclass
class AuditResult:
    """``epsilon_lower``: ε is at least this, with probability ``confidence`` over the runs."""

    epsilon_lower: float
    threshold: float
    fpr_upper: float
    fnr_upper: float
    trials: int
    confidence: float


def _epsilon_from_rates(fpr, fnr, delta: float):
    """The ε that error rates (FPR, FNR) force, elementwise: the larger of log((1 − δ − FPR)/FNR)
    and log((1 − δ − FNR)/FPR), each where its numerator is positive, and at least 0."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    out = np.zeros(np.broadcast(fpr, fnr).shape)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero rate gives inf; masked entries nan
        for a, b in ((fpr, fnr), (fnr, fpr)):
            num = 1 - delta - a
            out = np.maximum(out, np.where(num > 0, np.log(num) - np.log(b), 0.0))
    return float(out) if out.ndim == 0 else out


def epsilon_lower_bound(scores_d: Sequence[float], scores_d2: Sequence[float], delta: float,
                        confidence: float = 0.95) -> AuditResult:
    """Lower bound on ε from statistics of runs on D (``scores_d``) and on D' (``scores_d2``).

    The test says "D'" when the statistic exceeds a threshold (so give D' the larger mean). The
    threshold maximises the empirical bound on the first half of each sample; the Clopper–Pearson
    bounds (each at level (1 − confidence)/2, a union bound) use the second half.
    """
    s0, s1 = np.asarray(scores_d, dtype=float), np.asarray(scores_d2, dtype=float)
    h0, h1 = len(s0) // 2, len(s1) // 2
    sel0, sel1, ev0, ev1 = np.sort(s0[:h0]), np.sort(s1[:h1]), s0[h0:], s1[h1:]
    alpha = (1 - confidence) / 2

    candidates = np.unique(np.quantile(np.concatenate([sel0, sel1]), np.linspace(0.0, 1.0, 401)))
    fp = h0 - np.searchsorted(sel0, candidates, side="right")  # errors on the selection half
    fn = np.searchsorted(sel1, candidates, side="right")
    bounds = _epsilon_from_rates(clopper_pearson_upper(fp, h0, alpha), clopper_pearson_upper(fn, h1, alpha), delta)
    best_t = float(candidates[int(np.argmax(bounds))])
    n0, n1 = len(ev0), len(ev1)
    fpr_u = clopper_pearson_upper(int(np.sum(ev0 > best_t)), n0, alpha)
    fnr_u = clopper_pearson_upper(int(np.sum(ev1 <= best_t)), n1, alpha)
    return AuditResult(_epsilon_from_rates(fpr_u, fnr_u, delta), best_t, fpr_u, fnr_u, n0 + n1, confidence)


def trial_sums(parts: Sequence[ClippedSum], masks: torch.Tensor) -> ClippedSum:
    """The clipped sums of many trials in one: trial t sums the parts that row t of the 0/1
    ``masks`` [trials, len(parts)] selects (the records a sampler drew, each clipped on its own, as
    micro-batches are; or one whole batch per trial). The aggregate's tensors gain a leading trial
    axis, which a Gaussian release noises coordinate by coordinate like any other."""
    masks = torch.as_tensor(masks)
    agg = parts[0].aggregate.clone()
    agg.tensors = {k: torch.einsum("tp,p...->t...", masks.to(t.dtype),
                                   torch.stack([p.aggregate.tensors[k] for p in parts]))
                   for k, t in agg.tensors.items()}
    first = parts[0]
    return ClippedSum(agg, first.count, first.clipped, first.nonfinite, first.loss_sum, first.kind)


def projections(value: Aggregate, direction: Aggregate) -> np.ndarray:
    """One statistic per trial: each row of a (stacked) released aggregate projected on the unit
    vector along ``direction`` (an unstacked aggregate of the same layout)."""
    keys = sorted(direction.tensors)
    u = torch.cat([direction.tensors[k].reshape(-1).double() for k in keys])
    u = u / u.norm()
    rows = value.tensors[keys[0]].numel() // direction.tensors[keys[0]].numel()
    x = torch.cat([value.tensors[k].reshape(rows, -1).double() for k in keys], 1)
    return (x @ u).numpy()
