"""Theorem settings and the remaining errata (T rule, App. E's σ, KLT's Thm 4.1 settings)."""

from __future__ import annotations

import math

import pytest

from dpreg_klt import theory as klt
from dpreg_ztc import theory as ztc
from conftest import make_run
from nonsmooth_helpers import recipe


def test_T_rule_max_not_min():
    """Spec 001 §1.6 [ERRATUM]: with the error bound A·T + B/√T + C/T (d = 10, L = F* = 1, δ = 0.1,
    M = 1e6, ρ = 100) the printed min gives 0.30, the max 0.124, the numerical optimum 0.118."""
    d, L, F, delta, M, rho = 10, 1.0, 1.0, 0.1, 1e6, 100.0
    A, B, C = 2 * (F + 2 * L * delta) / (delta * M), math.sqrt(d) * L, d ** 1.5 * L / rho
    t1, t2 = (B / A) ** (2 / 3), (C / A) ** 0.5
    assert ztc.error_bound(min(t1, t2), A, B, C) == pytest.approx(0.30, abs=0.005)
    assert ztc.error_bound(max(t1, t2), A, B, C) == pytest.approx(0.124, abs=0.001)
    best = min(ztc.error_bound(t, A, B, C) for t in range(1, 20000))
    assert best == pytest.approx(0.118, abs=0.001)
    # theory_T applies max: as ρ grows it tends to the non-private T1, never to 0
    ts = [ztc.theory_T(d, L, delta, int(M), F, r) for r in (1.0, 100.0, 1e6, math.inf)]
    t_np = ztc.theory_T(d, L, delta, int(M), F, math.inf)
    assert ts[-1] == t_np and all(t >= t_np for t in ts)
    assert ztc.theory_T(d, L, delta, int(M), F, 1e6, rule="min") < t_np // 10  # the printed rule collapses


def test_theory_T_is_the_default_episode_length(tmp_path):
    run = make_run(recipe("ztc_o2nc_tree", {"name": "l1_distance", "dim": 5, "n": 40000},
                          estimator={"smooth_radius": 0.1}, privacy={"rho": 0.5, "delta": 1e-6}), tmp_path)
    s = run.algorithm.settings
    assert s.period == ztc.theory_T(5, 1.0, 0.1, 40000, 1.0, 1.0)
    assert (s.batch_first, s.batch_rest, s.radius) == (s.period + 1, 1, pytest.approx(0.1 / s.period))


def test_naive_sigma_is_calibrated_to_the_replace_one_sensitivity(tmp_path):
    """Spec 001 §1.7 [ERRATUM]: the sensitivity of App. E's estimate is 2dL/B, so σ = 2dL/(Bρ); the
    printed dL/(Bρ) would make each step (2ρ)²/2-zCDP instead of ρ²/2."""
    d, L, B, rho = 5, 1.0, 2, 1.0
    run = make_run(recipe({"name": "ztc_naive", "episode_len": 10, "batch_size": B},
                          {"name": "l1_distance", "dim": d, "n": 4000}, estimator={"smooth_radius": 0.1},
                          privacy={"rho": rho ** 2 / 2, "delta": 1e-6}), tmp_path)
    sigma = run.privatizer.noise_multiplier * run.privatizer.sensitivities()["fresh"]
    assert sigma == pytest.approx(ztc.naive_sigma(d, L, B, rho), rel=2e-4)
    printed = ztc.naive_sigma(d, L, B, rho, printed=True)
    assert (2 * d * L / B) ** 2 / (2 * printed ** 2) == pytest.approx(4 * rho ** 2 / 2)


def test_klt_theorem_settings():
    """Spec 002 §1.8: M = α/(4D) with M·D ≤ α; Σ from Thm 3.1; Thm 4.1's balanced (D, T) keep
    D·T = Φ/β like the printed ones ([AMBIG-9]); FO needs about d²/… fewer perturbations than ZO."""
    alpha, L, phi, d, eps = 0.1, 1.0, 2.0, 5, 1.0
    D = klt.theory_radius(phi, alpha, L, 5000, d, eps)
    M = klt.theory_window(alpha, D)
    assert M >= 1 and M * D <= alpha
    assert klt.theory_period(alpha, eps, D, d) == math.ceil((alpha / (eps * D)) ** (2 / 3) + alpha / (D * math.sqrt(d)))
    for rule in ("balanced", "printed"):
        Dt, T, _ = klt.erm_settings(phi, alpha, L, 0.3, d, rule)
        assert Dt * T == pytest.approx(phi / 0.3, rel=1e-3)
    gamma = 1e-6
    zo, fo = klt.theory_dirs_zo(d, alpha, D, gamma), klt.theory_dirs_fo(d, alpha, D, gamma)
    assert zo / fo == pytest.approx((d + 1) ** 2 / 4, rel=0.05)
