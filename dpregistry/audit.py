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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy import stats


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """One-sided (1 − alpha) upper confidence bound on a binomial rate with k successes in n."""
    if k >= n:
        return 1.0
    return float(stats.beta.ppf(1 - alpha, k + 1, n - k))


def _cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    k = np.asarray(k)
    out = np.ones(k.shape, dtype=float)
    m = k < n
    out[m] = stats.beta.ppf(1 - alpha, k[m] + 1, n - k[m])
    return out


@dataclass
class AuditResult:
    """``epsilon_lower``: ε is at least this, with probability ``confidence`` over the runs."""

    epsilon_lower: float
    threshold: float
    fpr_upper: float
    fnr_upper: float
    trials: int
    confidence: float


def _epsilon_from_rates(fpr: float, fnr: float, delta: float) -> float:
    vals = []
    for a, b in ((fpr, fnr), (fnr, fpr)):
        num = 1 - delta - a
        if num > 0:
            vals.append(math.inf if b == 0 else math.log(num / b))
    return max([0.0] + vals)


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
    fpr, fnr = _cp_upper(fp, h0, alpha), _cp_upper(fn, h1, alpha)
    bounds = [_epsilon_from_rates(a, b, delta) for a, b in zip(fpr, fnr)]
    best_t = float(candidates[int(np.argmax(bounds))])
    n0, n1 = len(ev0), len(ev1)
    fpr_u = clopper_pearson_upper(int(np.sum(ev0 > best_t)), n0, alpha)
    fnr_u = clopper_pearson_upper(int(np.sum(ev1 <= best_t)), n1, alpha)
    return AuditResult(_epsilon_from_rates(fpr_u, fnr_u, delta), best_t, fpr_u, fnr_u, n0 + n1, confidence)


def audit(mechanism: Callable[[int], float], trials: int, delta: float, confidence: float = 0.95) -> AuditResult:
    """Run ``mechanism(0)`` (on D) and ``mechanism(1)`` (on D') ``trials`` times each and bound ε.

    ``mechanism(which)`` returns one scalar statistic of a fresh release, larger on D' on average.
    """
    s0 = [mechanism(0) for _ in range(trials)]
    s1 = [mechanism(1) for _ in range(trials)]
    return epsilon_lower_bound(s0, s1, delta, confidence)


def release_mechanism(privatizer, run, totals, statistic: Callable) -> Callable[[int], float]:
    """An auditable mechanism from a privatizer's real release path.

    ``totals`` are the privatizer's ``clip_sum`` of the two neighbouring batches; each call
    releases a copy of one of them with ``privatizer.release(copy, run)``, which draws fresh
    noise from the run's secret noise source (one more release in the run's current step), and
    returns ``statistic(release.value)``.
    """
    from .stages import ClippedSum

    def mechanism(which: int) -> float:
        t = totals[which]
        copy = ClippedSum(t.aggregate.clone(), t.count, t.clipped, t.nonfinite, t.loss_sum, t.kind)
        return float(statistic(privatizer.release(copy, run).value))

    return mechanism
