"""Calibration: every returned multiplier fits the budget, and it is tight, against a plain
fine-grained bisection (written here) and against the exact Gaussian curve."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpregistry import UserError
from dpregistry.privacy.accountant import Budget, make_accountant, solve_boundary
from dpregistry.privacy.events import Exponential, Gaussian, PoissonSampled, clipped_sum_sensitivity
from dpregistry.stages import Charge

from test_accounting_closed_form import exact_epsilon


def poisson_plan(q, steps, relation):
    sens = clipped_sum_sensitivity(1.0, relation)
    return lambda z: [Charge(PoissonSampled(q, Gaussian(std=z, sensitivity=sens)) if q < 1
                             else Gaussian(std=z, sensitivity=sens), count=steps)]


def assert_tight(acc, plan, z, rtol):
    """z fits, and z/(1 + rtol) does not: the smallest multiplier that fits (what a plain,
    fine-grained bisection would converge to) lies in (z/(1 + rtol), z]."""
    assert acc.fits(plan(z)) and acc.epsilon(extra=plan(z)) <= acc.budget.epsilon
    assert not acc.fits(plan(z / (1 + rtol)))


PLD_CASES = [("add_remove", 0.01, 1000, 1.0), ("replace_one", 0.01, 1000, 1.0), ("replace_one", 0.1, 300, 4.0)]


@pytest.mark.parametrize("relation,q,steps,eps", PLD_CASES)
def test_pld_calibration_fits_and_is_tight(relation, q, steps, eps):
    budget = Budget(eps, 1e-5, relation=relation)
    acc = make_accountant("pld", budget)
    plan = poisson_plan(q, steps, relation)
    t0 = time.perf_counter()
    z = acc.calibrate(plan)
    seconds = time.perf_counter() - t0
    assert_tight(acc, plan, z, rtol=2e-3)  # the documented bracket: 0.2% at the configured discretization
    print(f"pld {relation} q={q} T={steps} ε={eps}: z={z:.5f} in {seconds:.2f}s")
    if relation == "add_remove":  # within 0.5% of the boundary at a 2× finer discretization too
        finer = make_accountant({"name": "pld", "discretization": 5e-5}, budget)
        assert_tight(finer, plan, z, rtol=5e-3)


def test_pld_calibration_of_composed_gaussians_matches_the_closed_form():
    """T unsampled Gaussians compose to one Gaussian with μ = sqrt(T)/z: the exact boundary is
    the μ with ε(μ, δ) = target (Balle–Wang), independent of any accountant."""
    from scipy import optimize

    T, eps, delta = 50, 3.0, 1e-5
    mu = optimize.brentq(lambda m: exact_epsilon(m, delta) - eps, 0.05, 20.0, xtol=1e-12)
    exact_z = math.sqrt(T) / mu
    acc = make_accountant("pld", Budget(eps, delta, relation="add_remove"))
    z = acc.calibrate(poisson_plan(1.0, T, "add_remove"))
    assert exact_z <= z <= exact_z * 1.005


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_rdp_calibration_equals_a_search_on_every_order(relation):
    """The windowed search is as tight as one on every order: z/(1 + rtol) fails on all orders."""
    budget = Budget(2.0, 1e-5, relation=relation)
    for q, steps in [(0.02, 2000), (0.3, 50), (1.0, 10)]:
        plan = poisson_plan(q, steps, relation)
        acc = make_accountant("rdp", budget)
        assert_tight(acc, plan, acc.calibrate(plan), rtol=1e-4)


def test_calibration_with_partitions_and_mixed_events_is_tight():
    """A plan with parallel composition (disjoint partitions) and a fixed zCDP charge."""
    budget = Budget(epsilon=1.0, delta=1e-6)

    def plan(z):
        return [Charge(Exponential(0.05)), Charge(Gaussian(z, 2.0), "a", 20), Charge(Gaussian(z, 2.0), "b", 30),
                Charge(Gaussian(2 * z, 2.0), count=5)]

    for name in ("rdp", "zcdp", "pld", "rdp_filter"):
        acc = make_accountant(name, budget)
        z = acc.calibrate(plan, rtol=1e-3)
        assert acc.fits(plan(z)) and not acc.fits(plan(z / (1 + 2e-3))), name
        # the worst partition (b: 30 steps) binds: dropping partition a changes nothing
        assert acc.epsilon(extra=plan(z)) == pytest.approx(
            acc.epsilon(extra=[c for c in plan(z) if c.partition != "a"]), rel=1e-9)


def test_calibration_continues_an_existing_ledger():
    acc = make_accountant("rdp", Budget(2.0, 1e-5))
    plan = poisson_plan(0.02, 1000, "replace_one")
    fresh = acc.calibrate(plan)
    acc.charge(plan(fresh * 2), 0)  # half the steps already spent at twice the noise
    more = acc.calibrate(plan)
    assert more > fresh and acc.fits(plan(more)) and not acc.fits(plan(more / (1 + 1e-3)))


def test_calibration_reports_an_impossible_budget():
    acc = make_accountant("rdp", Budget(1.0, 1e-5))
    with pytest.raises(UserError, match="no noise multiplier"):
        acc.calibrate(lambda z: [Charge(PoissonSampled(0.5, Gaussian(z, 2.0)))], hi=0.5)
    assert acc.calibrate(lambda z: [], lo=0.01) == 0.01  # nothing to pay for: the floor


@settings(max_examples=200, deadline=None, derandomize=True)
@given(root=st.floats(min_value=1e-2, max_value=1e3), k=st.floats(min_value=0.2, max_value=5.0),
       guess=st.floats(min_value=1e-2, max_value=1e3), rtol=st.sampled_from([1e-2, 1e-3, 1e-5]),
       kind=st.sampled_from(["smooth", "step", "infinite below"]))
def test_solver_returns_a_fitting_bracket_end_within_rtol(root, k, guess, rtol, kind):
    calls = []

    def slack(z):
        calls.append(z)
        if kind == "step":
            return -1.0 if z >= root else 1.0
        if kind == "infinite below" and z < root / 2:
            return math.inf
        return k * math.log(root / z) + 0.3 * math.log(root / z) ** 2 * (z < root)

    z = solve_boundary(slack, lo=1e-3, hi=1e4, rtol=rtol, guess=guess)
    assert slack(z) <= 0
    assert root <= z <= root * (1 + rtol) * (1 + 1e-12)
    assert len(calls) < 120


@pytest.mark.slow
def test_a_calibration_stopped_by_the_pld_size_bound_says_so():
    """At q = 256/67,349 the boundary lies where a replace-one PLD needs more points than its bound:
    the calibration returns a fitting multiplier that spends well under the target (a coarser
    discretization reaches the target with less noise) and says why; a tight one says nothing."""
    from dpregistry.progress import saying

    budget = Budget(6.0, 1e-5, relation="replace_one")
    plan = poisson_plan(256 / 67349, 30, "replace_one")
    said: list[str] = []
    acc = make_accountant("pld", budget)
    with saying(said.append):
        z = acc.calibrate(plan)
    eps = acc.epsilon(extra=plan(z))
    assert eps <= 6.0 and eps < 0.98 * 6.0
    coarse = make_accountant({"name": "pld", "discretization": 1e-3}, budget)
    z_coarse = coarse.calibrate(plan)  # the budget allowed less noise, as the message says
    assert z_coarse < 0.9 * z and coarse.epsilon(extra=plan(z_coarse)) == pytest.approx(6.0, rel=1e-2)
    assert len(said) == 1 and f"{z:.4g}" in said[0] and "size limit" in said[0] and "discretization" in said[0]
    said.clear()
    with saying(said.append):
        make_accountant("pld", budget).calibrate(poisson_plan(0.01, 1000, "replace_one"))
    assert said == []
