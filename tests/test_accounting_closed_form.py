"""Accountants against closed forms computed independently here: the Gaussian mechanism's exact
(ε, δ) curve (Balle & Wang 2018, Thm 8), zCDP composition and conversions (spec 004 §2 reference
values), the exponential mechanism's charges and the specs' per-query zCDP costs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize
from scipy.stats import norm

from dpregistry.privacy.accountant import Budget, make_accountant
from dpregistry.privacy.conversions import (epsilon_to_zcdp, gaussian_zcdp, zcdp_to_delta,
                                            zcdp_to_epsilon)
from dpregistry.privacy.events import (ZCDP, Composed, Exponential, Gaussian, SelfComposed,
                                       TreeAggregation)
from dpregistry.stages import Charge


def exact_delta(mu: float, eps: float) -> float:
    """δ(ε) of the Gaussian mechanism with Δ/σ = μ: Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)."""
    return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu)


def exact_epsilon(mu: float, delta: float) -> float:
    if exact_delta(mu, 0.0) <= delta:
        return 0.0
    return optimize.brentq(lambda e: exact_delta(mu, e) - delta, 0.0, 500.0, xtol=1e-12)


def acc(name, **budget):
    return make_accountant(name, Budget(**budget))


def eps_of(name, events, delta, **kw):
    return acc(name, delta=delta, **kw).epsilon(delta, extra=[Charge(e, count=n) for e, n in events])


GAUSSIAN_CASES = [(1.0, 1.0, 1e-5), (2.0, 3.0, 1e-5), (0.5, 1.0, 1e-6), (4.0, 1.0, 1e-3)]


@pytest.mark.parametrize("std,sens,delta", GAUSSIAN_CASES)
def test_pld_matches_the_exact_gaussian_curve(std, sens, delta):
    truth = exact_epsilon(sens / std, delta)
    got = eps_of("pld", [(Gaussian(std, sens), 1)], delta)
    assert truth <= got <= truth + 2e-3  # pessimistic, and tight to the discretization
    # δ for a given ε, the other direction of the curve
    a = acc("pld", delta=delta)
    a.charge([Charge(Gaussian(std, sens))], 0)
    for e in (0.5 * truth, truth, 2 * truth):
        assert exact_delta(sens / std, e) <= a.delta(e) <= exact_delta(sens / std, e) * 1.02 + 1e-12


@pytest.mark.parametrize("relation", ["replace_one", "add_remove"])
def test_composition_of_gaussians_is_a_gaussian(relation):
    """k releases at Δ/σ = μ_i compose to one Gaussian with μ = sqrt(Σ μ_i²) (GDP), for PLD; the
    relation does not matter for an unsampled Gaussian of a given L2 distance."""
    events = [(Gaussian(3.0, 1.0), 40), (Composed((Gaussian(2.0, 1.0), Gaussian(6.0, 2.0))), 5)]
    mu = math.sqrt(40 / 9 + 5 * (1 / 4 + 1 / 9))
    truth = exact_epsilon(mu, 1e-5)
    got = make_accountant("pld", Budget(delta=1e-5, relation=relation)).epsilon(
        1e-5, extra=[Charge(e, count=n) for e, n in events])
    assert truth <= got <= truth + 5e-3
    same = eps_of("pld", [(SelfComposed(Gaussian(3.0, 1.0), 40), 1),
                          (Composed((Gaussian(2.0, 1.0), Gaussian(6.0, 2.0))), 5)], 1e-5)
    assert same == pytest.approx(got, abs=1e-9)


@pytest.mark.parametrize("std,sens,delta", GAUSSIAN_CASES)
def test_rdp_curve_of_a_gaussian_is_alpha_over_2z2_and_bounds_the_truth(std, sens, delta):
    from dpreg_accounting.accountants import ORDERS, rdp_curve

    curve = rdp_curve(Gaussian(std, sens), "replace_one")
    np.testing.assert_allclose(curve, np.array(ORDERS) * sens ** 2 / (2 * std ** 2), rtol=1e-12)
    truth = exact_epsilon(sens / std, delta)
    got = eps_of("rdp", [(Gaussian(std, sens), 1)], delta)
    assert truth <= got <= truth * 1.3 + 0.05  # RDP is an upper bound, somewhat loose
    a = acc("rdp", delta=delta)
    a.charge([Charge(Gaussian(std, sens))], 0)
    assert exact_delta(sens / std, got) <= a.delta(got) <= delta * (1 + 1e-9)  # δ(ε) inverts ε(δ)


def test_zcdp_reference_values_spec004():
    """spec 004 §2: ρ = 0.5, δ = 1e-5 → ε = 5.29853; ρ = 1, δ = 1e-6 → 8.43384; ε = 1,
    δ = 1e-5 → ρ = 0.0208199. The inverse round-trips to 1e-12."""
    assert zcdp_to_epsilon(0.5, 1e-5) == pytest.approx(5.29853, abs=5e-6)
    assert zcdp_to_epsilon(1.0, 1e-6) == pytest.approx(8.43384, abs=5e-6)
    assert epsilon_to_zcdp(1.0, 1e-5) == pytest.approx(0.0208199, abs=5e-8)
    for rho in (1e-4, 0.0208199, 0.5, 3.0):
        for delta in (1e-3, 1e-6, 1e-10):
            assert epsilon_to_zcdp(zcdp_to_epsilon(rho, delta), delta) == pytest.approx(rho, rel=1e-12)
            eps = zcdp_to_epsilon(rho, delta)
            assert zcdp_to_delta(rho, eps) == pytest.approx(delta, rel=1e-9)
    # spec 001 §2.7: a ρ'²/2-zCDP run is (ρ'²/2 + ρ'·sqrt(2 ln 1/δ), δ)-DP; inverse sqrt(2L+2ε) − sqrt(2L)
    rp, delta = 0.7, 1e-5
    L = math.log(1 / delta)
    assert zcdp_to_epsilon(rp ** 2 / 2, delta) == pytest.approx(rp ** 2 / 2 + rp * math.sqrt(2 * L), rel=1e-12)
    eps = 2.0
    assert math.sqrt(2 * epsilon_to_zcdp(eps, delta)) == pytest.approx(math.sqrt(2 * L + 2 * eps) - math.sqrt(2 * L))


def test_zcdp_composition_adds_and_matches_rdp_linear_curves():
    """spec 004 A1: gaussian_zcdp(1, 1) = 0.5, costs add, and RDP(α) = ρα."""
    from dpreg_accounting.accountants import ORDERS, rdp_curve

    assert gaussian_zcdp(1.0, 1.0) == 0.5
    z = acc("zcdp", rho=10.0)
    charges = [Charge(Gaussian(1.0, 1.0), count=3), Charge(ZCDP(0.2)), Charge(Gaussian(2.0, 2.0), count=2),
               Charge(TreeAggregation(std=3.0, sensitivity=1.0, nodes_per_record=5))]
    for step, c in enumerate(charges):
        z.charge([c], step)
    assert z.rho() == pytest.approx(3 * 0.5 + 0.2 + 2 * 0.5 + 5 / 18, rel=1e-15)
    np.testing.assert_allclose(rdp_curve(ZCDP(0.2), "replace_one"), 0.2 * np.array(ORDERS), rtol=1e-15)
    # ε reported by each conversion: the standard bound, and the tighter numerical one
    r = z.rho()
    assert z.epsilon(1e-5) == pytest.approx(zcdp_to_epsilon(r, 1e-5), rel=1e-15)
    tight = make_accountant({"name": "zcdp", "conversion": "tight"}, Budget(rho=10.0))
    tight.ledger = z.ledger
    assert exact_epsilon(math.sqrt(2 * r), 1e-5) <= tight.epsilon(1e-5) < z.epsilon(1e-5)
    assert tight.delta(z.epsilon(1e-5)) < 1e-5 and tight.delta(tight.epsilon(1e-5)) <= 1e-5 * (1 + 1e-9)


def test_zcdp_tight_budget_is_the_largest_rho_whose_tight_conversion_fits():
    from dpreg_accounting.accountants import _tight_epsilon

    std = make_accountant("zcdp", Budget(epsilon=2.0, delta=1e-6)).budget_rho()
    tight = make_accountant({"name": "zcdp", "conversion": "tight"}, Budget(epsilon=2.0, delta=1e-6)).budget_rho()
    assert std == pytest.approx(epsilon_to_zcdp(2.0, 1e-6))
    assert tight > std
    assert _tight_epsilon(tight, 1e-6) <= 2.0 < _tight_epsilon(tight * (1 + 1e-9), 1e-6)
    both = make_accountant("zcdp", Budget(epsilon=2.0, delta=1e-6, rho=0.01)).budget_rho()
    assert both == 0.01  # both targets bind


def test_exponential_mechanism_charges_spec004():
    """A3: ε²/2 under the pure-DP conversion, ε²/8 bounded range. 3-SP under replace-one is
    2√ρ-DP, which bounded range charges ρ/2 (spec 004 §1.3)."""
    from dpreg_accounting.accountants import ORDERS, rdp_curve, zcdp_rho

    assert zcdp_rho(Exponential(0.8, bounded_range=False)) == pytest.approx(0.32)
    assert zcdp_rho(Exponential(0.8)) == pytest.approx(0.08)
    rho = 0.3
    assert zcdp_rho(Exponential(2 * math.sqrt(rho))) == pytest.approx(rho / 2)
    np.testing.assert_allclose(rdp_curve(Exponential(0.8), "replace_one"), 0.08 * np.array(ORDERS), rtol=1e-12)
    # PLD: a pure ε-DP mechanism's profile: δ(ε') = 0 for ε' >= ε
    a = acc("pld", delta=1e-6)
    a.charge([Charge(Exponential(0.8))], 0)
    assert a.epsilon(1e-9) <= 0.8 + 1e-3 and a.delta(0.8 + 1e-3) == 0.0


def test_kl_ledger_costs_spec004_table():
    """True zCDP costs Δ²/(2σ²) of spec 004 §2's queries under replace-one (Δ = 2L0/n)."""
    from dpreg_accounting.accountants import zcdp_rho

    n, L0, rho, K = 1000, 1.3, 0.5, 7
    delta_q = 2 * L0 / n
    anchor = Gaussian(std=L0 * math.sqrt(K) / (n * math.sqrt(rho)), sensitivity=delta_q)
    assert zcdp_rho(anchor) == pytest.approx(2 * rho / K)
    norm_query = Gaussian(std=L0 / (math.sqrt(n) * rho ** 0.25), sensitivity=delta_q)
    assert zcdp_rho(norm_query) == pytest.approx(2 * math.sqrt(rho) / n)
    sigma_t = 0.01
    assert zcdp_rho(Gaussian(sigma_t, delta_q)) == pytest.approx(2 * L0 ** 2 / (n ** 2 * sigma_t ** 2))


@pytest.mark.parametrize("name", ["rdp", "rdp_filter", "pld"])
def test_tree_event_is_accounted_as_a_gaussian_of_sensitivity_s_sqrt_c(name):
    """A tree period is the Gaussian mechanism of sensitivity Δ·sqrt(nodes) (spec 001 §2.4): every
    (ε, δ) accountant reports at least its exact ε, and the same ε as the equivalent Gaussian."""
    tree = TreeAggregation(std=4.0, sensitivity=1.0, nodes_per_record=4)
    got = eps_of(name, [(tree, 3)], 1e-5, epsilon=50.0)
    assert got == pytest.approx(eps_of(name, [(tree.as_gaussian(), 3)], 1e-5, epsilon=50.0), rel=1e-9)
    assert exact_epsilon(math.sqrt(3) * math.sqrt(4) / 4.0, 1e-5) <= got  # 3 periods, μ = sqrt(3·4)/4


def test_epsilon_to_zcdp_never_rounds_above_the_target():
    """The ρ budget derived from (ε, δ) converts back to at most ε, not ε plus a rounding error
    (the standard conversion's sqrt(ε+L) − sqrt(L) cancels for small ε), and a zcdp run that
    spends its whole budget reports at most the target ε."""
    rng = np.random.default_rng(0)
    for eps, delta in zip(10 ** rng.uniform(-3, 2, 2000), 10 ** rng.uniform(-12, -2, 2000)):
        rho = epsilon_to_zcdp(eps, delta)
        assert zcdp_to_epsilon(rho, delta) <= eps
        assert rho == pytest.approx((math.sqrt(eps + math.log(1 / delta)) - math.sqrt(math.log(1 / delta))) ** 2,
                                    rel=1e-9)
    assert epsilon_to_zcdp(math.inf, 1e-5) == math.inf
    a = acc("zcdp", epsilon=0.37, delta=1e-7)
    a.charge([Charge(ZCDP(a.budget_rho()))], 0)
    assert a.epsilon() <= 0.37
