"""The audit's statistics: Clopper–Pearson bounds and the ε lower bound on a mechanism of known ε.

The end-to-end audits of the real mechanisms (and of broken ones) are in test_privacy_audit_e2e.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from dpregistry.audit import clopper_pearson_upper, epsilon_lower_bound


def test_clopper_pearson_matches_exact_binomial_tail():
    from scipy import stats

    for k, n in [(0, 100), (3, 1000), (50, 200)]:
        u = clopper_pearson_upper(k, n, 0.025)
        assert stats.binom.cdf(k, n, u) == pytest.approx(0.025, rel=1e-6)  # P(X <= k | p = u) = α
    assert clopper_pearson_upper(10, 10, 0.05) == 1.0
    many = clopper_pearson_upper([0, 3, 10], 10, 0.05)  # elementwise, the same numbers
    assert list(many) == [clopper_pearson_upper(k, 10, 0.05) for k in (0, 3, 10)]


def test_lower_bound_is_valid_for_a_mechanism_with_known_epsilon():
    """Randomized response with ε = 1 has FPR = FNR = 1/(1+e): the bound stays below 1, and
    approaches it with many runs."""
    g = torch.Generator().manual_seed(0)
    n = 200_000
    p = 1 / (1 + math.e)
    s0 = (torch.rand(n, generator=g) < p).double().numpy()       # says "D'" wrongly with prob p
    s1 = (torch.rand(n, generator=g) >= p).double().numpy()
    res = epsilon_lower_bound(s0, s1, delta=0.0)
    assert 0.9 < res.epsilon_lower <= 1.0
