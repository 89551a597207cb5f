"""KL plugin: schedule constants against the spec's reference numbers, and the two corrected
privacy points (the paper's sensitivity convention; Alg. 3's closed-form charge). Pure math, fast."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpreg_kl.schedules import (AdaptiveConstants, ProximalSchedule, SpiderSchedule, exponential_log_weights,
                                selection_epsilon)


def config_a(**kw):
    """Spec §5 C4 (a): the D1 quadratic, paper constants."""
    args = dict(n=10**6, rho=1.0, d=5, beta=0.1, f0=0.1, gamma=math.sqrt(2.5), kappa=2.0, lipschitz=1.0,
                smoothness=1.0, calibration="paper")
    args.update(kw)
    return SpiderSchedule(**args)


def config_b(**kw):
    """Spec §5 C4 (b): κ = 4/3."""
    args = dict(n=10**7, rho=1.0, d=5, beta=0.1, f0=0.0228556, gamma=100 ** 0.25 / 4, kappa=4 / 3,
                lipschitz=1.0, smoothness=12.0, calibration="paper")
    args.update(kw)
    return SpiderSchedule(**args)


def test_golden_schedule_a():
    s = config_a()
    expect = {"c": 1.00625, "K_raw": 3671.24, "beta_prime": 2.7233e-5, "phi_floor": 4.9404e-4,
              "sigma_hat": 6.0597e-5}
    for key, value in expect.items():
        assert getattr(s, key) == pytest.approx(value, rel=1e-4), key
    assert s.K == 3672
    first = {"phi": 0.099379, "sigma": 1.20817e-5, "r": 0.049845, "theta": 0.174456}
    for key, value in first.items():
        assert getattr(s, key)[0] == pytest.approx(value, rel=1e-4), key
    assert s.T[0] == 1


def test_golden_schedule_b():
    s = config_b()
    assert s.K == 53842
    assert s.phi_floor == pytest.approx(9.886e-4, rel=1e-4)
    assert s.T[0] == 2 and (s.f0 / s.phi[0]) ** s.e == pytest.approx(1.0002, abs=1e-4)
    assert s.T[-1] == 5


@pytest.mark.parametrize("make", [config_a, config_b])
@pytest.mark.parametrize("calibration", ["paper", "exact"])
def test_schedule_shape(make, calibration):
    s = make(calibration=calibration)
    assert np.all(np.diff(s.phi) <= 0) and s.phi[-1] >= s.phi_floor
    assert np.all(np.diff(s.T) >= 0)
    closed = np.maximum(s.f0 * s.c ** -np.arange(1, s.K + 1, dtype=float), s.phi_floor)
    np.testing.assert_allclose(s.phi, closed, rtol=1e-12)
    if s.kappa == 2:
        assert np.all(s.T == 1) and s.worst_case_releases == s.K  # no difference query is ever issued
    assert s.worst_case_releases == s.K + int(np.sum(s.T - 1))


def true_cost(s: SpiderSchedule) -> tuple[float, float]:
    """Replace-one costs recomputed from the formulas of spec §2's ledger table (independently of
    the schedule's helpers): anchor Δ = 2L0/n, difference Δ = 2L1 r_k/n."""
    n = s.n
    anchors = s.K * (2 * s.lipschitz / n) ** 2 / (2 * s.sigma_hat ** 2)
    diffs = sum((T - 1) * (2 * s.smoothness * r / n) ** 2 / (2 * sig ** 2) for T, r, sig in zip(s.T, s.r, s.sigma))
    return anchors, diffs


def test_paper_calibration_undercharges_replace_one():
    """Corrected point 1 (spec §0.1, [AMBIG-5]): Theorem 1 claims ρ; at the paper's σ's the true
    replace-one cost is 2ρ for the anchors alone plus up to ρ/8 for the differences."""
    for s in (config_a(), config_b()):
        anchors, diffs = true_cost(s)
        assert anchors == pytest.approx(2 * s.rho, rel=1e-12)
        assert 0 <= diffs <= s.rho / 8
        assert sum(s.planned_costs()) == pytest.approx(anchors + diffs, rel=1e-9)
    assert true_cost(config_b())[1] > 0.05  # κ < 2 issues difference queries
    # add/remove halves Δ: the paper's σ's then cost a quarter of replace-one's
    s = config_b(relation="add_remove")
    assert sum(s.planned_costs()) == pytest.approx(sum(true_cost(config_b())) / 4, rel=1e-9)


@pytest.mark.parametrize("make", [config_a, config_b])
@pytest.mark.parametrize("relation", ["replace_one", "add_remove"])
def test_exact_calibration_spends_at_most_rho(make, relation):
    s = make(calibration="exact", relation=relation)
    total = sum(s.planned_costs())
    assert total <= s.rho * (1 + 1e-12)
    assert total >= s.rho * (1 - 1e-9)  # and wastes nothing
    if relation == "replace_one":
        assert sum(true_cost(s)) == pytest.approx(total, rel=1e-9)
        # C_f = 16(a + b): 40 with θ = 1/2 (spec §1.1); at κ = 2 all of ρ goes to the anchors (a = √2)
        assert s.c_floor == pytest.approx(40.0 if s.kappa < 2 else 16 * math.sqrt(2), rel=1e-12)


def test_spider_degenerate_k():
    s = config_a(n=2, rho=1e-6)
    assert s.K_raw <= 0 and s.K == 0 and s.worst_case_releases == 0 and s.planned_costs() == (0.0, 0.0)


def test_proximal_schedule_costs():
    kw = dict(n=2000, rho=1.0, d=1, beta=0.1, f0=0.5, gamma=1.0, kappa=3.0, lipschitz=1.0, weak_convexity=1.0)
    paper = ProximalSchedule(**kw, calibration="paper")
    exact = ProximalSchedule(**kw, calibration="exact")
    assert paper.T == exact.T and paper.T_A == exact.T_A > 1000
    assert paper.T_A == math.ceil(2000 ** 2 * (1 / paper.T) * math.log(2 * paper.T / 0.1) ** 2)
    # Alg. 4 at the paper's σ_A² = 4L0²T_A/(n²ρ_A): (T_A − 1) queries of Δ = 2L0/n spend < ρ_A/2
    per_call = (paper.T_A - 1) * (2 / 2000) ** 2 / (2 * paper.sigma ** 2)
    assert per_call == pytest.approx(paper.planned_cost() / paper.T, rel=1e-12) and per_call < paper.rho_call / 2
    assert 1 - 2e-9 <= exact.planned_cost() <= 1.0 and exact.sigma < paper.sigma  # spent to the sizing margin
    capped = ProximalSchedule(**kw, calibration="exact", max_inner_steps=20)
    assert capped.capped and capped.T_A == 20 and 1 - 2e-9 <= capped.planned_cost() <= 1.0
    assert capped.radius == 0.5 and capped.lr(4) == 0.25


def test_adaptive_constants():
    c = AdaptiveConstants(n=10_000, rho=0.5, beta=0.1, lipschitz=2.0)
    n, rho, L0 = 10_000, 0.5, 2.0
    assert c.ell == pytest.approx(math.log(n * math.sqrt(rho) / 0.1))
    # norm query: Δ = 2L0/n, σ̂ = L0/(√n ρ^{1/4}): costs 2√ρ/n, so the filter allows ⌊n√ρ/2⌋ steps
    assert c.step_cost(math.inf) == pytest.approx(2 * math.sqrt(rho) / n, rel=1e-12)
    assert c.max_steps == math.floor(n * math.sqrt(rho) / 2)
    # the floor σ_min = 2L0/(n√ρ) costs ρ/2
    assert c.step_cost(c.sigma_min) - c.step_cost(math.inf) == pytest.approx(rho / 2, rel=1e-12)
    # σ_t is a function of N_t alone (B3), floored; N_t ≤ 0 (or NaN) gives the floor (B5)
    assert c.sigma_t(3.0, 7) == pytest.approx(3.0 / math.sqrt(7 * c.ell))
    for N in (0.0, -1e-9, -5.0, float("nan"), 1e-12):
        assert c.sigma_t(N, 7) == c.sigma_min
    # add/remove: σ's scaled by Δ/(2L0/n) = 1/2, so every query costs what it costs under replace-one
    a = AdaptiveConstants(n=n, rho=rho, beta=0.1, lipschitz=L0, relation="add_remove")
    assert a.sigma_norm == c.sigma_norm / 2
    assert a.step_cost(a.sigma_t(3.0, 7)) == pytest.approx(c.step_cost(c.sigma_t(3.0, 7)), rel=1e-12)


def test_paper_closed_form_undercharges_adaptive_gd():
    """Corrected point 2 (spec §1.3): the paper charges ρ_t = min{L0²dℓ/(n²N_t²), ρ/2} + √ρ/n. When
    N_t ≤ 0 the step runs at σ_min, whose true cost is ρ/2 (+ the norm query), but ρ_t is tiny for a
    large negative N_t; and for N_t > 0 it is half the replace-one cost."""
    c = AdaptiveConstants(n=10_000, rho=1.0, beta=0.1, lipschitz=1.0)
    d = 10
    sigma = c.sigma_t(-0.5, d)
    assert sigma == c.sigma_min
    true = c.step_cost(sigma)
    paper = c.paper_ledger_entry(-0.5, d)
    assert true == pytest.approx(0.5 + 2 * math.sqrt(1.0) / 10_000, rel=1e-12)
    assert paper < true / 100
    for N in (0.05, 0.3, 1.0):  # above the floor: the paper's entry is exactly half the true cost
        assert c.sigma_t(N, d) > c.sigma_min
        assert c.step_cost(c.sigma_t(N, d)) == pytest.approx(2 * c.paper_ledger_entry(N, d), rel=1e-12)


def test_exponential_mechanism_is_epsilon_dp():
    """B8: on a fixed trajectory, neighbouring data sets change every log-probability by ≤ ε."""
    rng = np.random.default_rng(0)
    n, d, T, L0 = 50, 4, 12, 1.0

    def clipped(g):
        return g * np.minimum(1.0, L0 / np.linalg.norm(g, axis=-1, keepdims=True))

    eps = selection_epsilon(0.5)
    assert eps ** 2 / 8 == pytest.approx(0.5)
    worst = 0.0
    for _ in range(200):
        G = clipped(rng.normal(size=(T, n, d)) * rng.uniform(0.1, 3))
        H = G.copy()
        H[:, 0] = clipped(rng.normal(size=(T, d)) * 5)  # replace one record's gradients everywhere
        norms_s = np.linalg.norm(G.mean(1), axis=1)
        norms_t = np.linalg.norm(H.mean(1), axis=1)
        lp = exponential_log_weights(norms_s, eps, 2 * L0 / n)
        lq = exponential_log_weights(norms_t, eps, 2 * L0 / n)
        assert np.exp(lp).sum() == pytest.approx(1.0)
        worst = max(worst, float(np.max(np.abs(lp - lq))))
    assert worst <= eps * (1 + 1e-12)
    assert worst > 0.1 * eps  # the check is not vacuous
