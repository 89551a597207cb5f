"""Privacy filters (fully adaptive composition): the zCDP filter and the Rényi filter never let
the charged total exceed the budget, whatever the sequence of costs; PLD/RDP are refused as
filters at recipe validation; an adaptive run stops cleanly when its filter refuses a charge."""

from __future__ import annotations

from dataclasses import dataclass

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_run, write_recipe
from dpregistry import Algorithm, BudgetExhausted, Charge, StepResult, UserError, hookimpl
from dpregistry.privacy.accountant import Budget, make_accountant, total_fits
from dpregistry.privacy.events import ZCDP, Gaussian

PARTITIONS = st.sampled_from([None, None, "a", "b"])
COSTS = st.one_of(
    st.just(0.0), st.just(math.inf),
    st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_subnormal=True),
    st.floats(min_value=1e-300, max_value=1e-200),
    st.sampled_from([0.1, 0.2, 0.3, 1 / 3, 0.7, 1.0]),  # sums that round across the budget
)


def exact_total(charged: list[tuple[Fraction, str | None]]) -> Fraction:
    """Σ over the records' worst partition, in exact rationals: unpartitioned + max partition."""
    parts: dict = {}
    for c, p in charged:
        parts[p] = parts.get(p, Fraction(0)) + c
    base = parts.pop(None, Fraction(0))
    return base + max(parts.values(), default=Fraction(0))


def _run_filter(acc, cost_of, seq):
    """Charge ``seq`` (event, partition) one by one; check the filter's decision each time."""
    charged: list = []
    for step, (event, part) in enumerate(seq):
        cost = cost_of(event)
        before = acc.ledger.to_json()
        try:
            acc.charge([Charge(event, part)], step)
            ok = True
        except BudgetExhausted:
            ok = False
            assert acc.ledger.to_json() == before  # a refused charge leaves no trace
        if math.isinf(cost):
            assert not ok
            continue
        would = exact_total(charged + [(Fraction(cost), part)])
        # the decision is exact: it accepts precisely the charges whose total stays within budget
        assert ok == (would <= acc._budget_exact), (cost, part, float(would))
        if ok:
            charged.append((Fraction(cost), part))
        assert exact_total(charged) <= acc._budget_exact
    return charged


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.floats(min_value=1e-9, max_value=50.0),
       seq=st.lists(st.tuples(COSTS, PARTITIONS), max_size=40))
def test_zcdp_filter_never_exceeds_its_budget(budget, seq):
    acc = make_accountant("zcdp", Budget(rho=budget))
    acc._budget_exact = Fraction(budget)
    _run_filter(acc, lambda e: e.rho, [(ZCDP(c), p) for c, p in seq])
    assert acc.rho() <= budget


@settings(max_examples=100, deadline=None, derandomize=True)
@given(budget=st.floats(min_value=1e-4, max_value=5.0),
       seq=st.lists(st.tuples(st.floats(min_value=0.05, max_value=50.0), PARTITIONS), max_size=30))
def test_zcdp_filter_with_gaussian_costs(budget, seq):
    """Costs computed from (Δ, σ) as the privatizers declare them: ρ = Δ²/(2σ²)."""
    from dpreg_accounting.accountants import zcdp_rho

    acc = make_accountant("zcdp", Budget(rho=budget))
    acc._budget_exact = Fraction(budget)
    _run_filter(acc, zcdp_rho, [(Gaussian(std=s, sensitivity=2.0), p) for s, p in seq])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(eps=st.floats(min_value=0.1, max_value=20.0), order=st.sampled_from([None, 2.0, 8.0, 32.0]),
       seq=st.lists(st.tuples(COSTS, PARTITIONS), max_size=30))
def test_renyi_filter_never_exceeds_its_order_budget(eps, order, seq):
    """At the filter's fixed order α a ρ-zCDP charge costs ρα (RDP); the total stays within B(α),
    and the ε it converts to stays within the target."""
    cfg = {"name": "rdp_filter"} if order is None else {"name": "rdp_filter", "order": order}
    acc = make_accountant(cfg, Budget(epsilon=eps, delta=1e-6))
    a = acc.order
    acc._budget_exact = Fraction(acc.order_budget())
    from dpreg_accounting.accountants import rdp_curve

    _run_filter(acc, lambda e: float(rdp_curve(e, "replace_one", (a,))[0]), [(ZCDP(c), p) for c, p in seq])
    assert acc.epsilon() <= eps
    assert acc.remaining() <= float(acc._budget_exact - exact_total(
        [(Fraction(float(rdp_curve(ZCDP(e["event"]["rho"]), "replace_one", (a,))[0])) * e["count"], e["partition"])
         for e in acc.ledger.to_json()]))


def test_filter_budget_is_exact_at_the_boundary():
    acc = make_accountant("zcdp", Budget(rho=1.0))
    acc.charge([Charge(ZCDP(0.5))], 0)
    acc.charge([Charge(ZCDP(0.5))], 1)  # exactly the budget: allowed
    with pytest.raises(BudgetExhausted):
        acc.charge([Charge(ZCDP(5e-324))], 2)  # the smallest positive cost no longer fits
    acc.charge([Charge(ZCDP(0.0))], 3)
    assert acc.rho() == 1.0 and acc.remaining() == 0.0
    # 0.1 + 0.2 > 0.3 in floats but 0.1 + 0.2 charged against 0.3 is decided exactly
    assert not total_fits({None: [(1, 0.1), (1, 0.2)]}, 0.3)  # Fraction(0.1)+Fraction(0.2) > 0.3
    assert total_fits({None: [(3, 0.1)]}, 0.30000000000000004)


def test_remaining_is_the_largest_charge_that_fits():
    acc = make_accountant("zcdp", Budget(rho=0.7))
    for step, c in enumerate([0.1, 0.2, 1 / 3]):
        acc.charge([Charge(ZCDP(c))], step)
    r = acc.remaining()
    assert acc.can_afford([Charge(ZCDP(r))])
    assert not acc.can_afford([Charge(ZCDP(math.nextafter(r, 1.0)))])
    assert r == pytest.approx(0.7 - 0.1 - 0.2 - 1 / 3)
    # per partition: the worst partition binds
    acc.charge([Charge(ZCDP(0.01), "a")], 3)
    assert acc.remaining("a") == pytest.approx(r - 0.01)
    assert acc.remaining("b") == pytest.approx(r)
    assert acc.remaining() == pytest.approx(r - 0.01)


def test_approved_plan_stays_reserved_for_unplanned_charges():
    """Charges outside an approved plan must fit together with the rest of the plan (which is
    then let through without another check)."""
    acc = make_accountant("zcdp", Budget(rho=1.0))
    planned = ZCDP(0.125)
    acc.approve([Charge(planned, count=8)])
    for step in range(4):
        acc.charge([Charge(planned)], step)
    with pytest.raises(BudgetExhausted):
        acc.charge([Charge(ZCDP(0.2))], 4)  # 0.5 spent + 0.5 still planned + 0.2 > 1
    acc.charge([Charge(ZCDP(0.0))], 4)    # an unplanned charge that fits with the plan
    for step in range(4, 8):
        acc.charge([Charge(planned)], step)
    assert acc.rho() == 1.0
    split = [Charge(ZCDP(0.1), count=10)]
    fresh = make_accountant("zcdp", Budget(rho=1.0))
    with pytest.raises(BudgetExhausted):
        fresh.approve(split)  # 10 × fl(0.1) exceeds 1 exactly: refused, and the message says why
    assert "rounding only" in fresh.overspend(split)
    fresh.approve([Charge(ZCDP(0.1 * (1 - 1e-9)), count=10)])


# ------------------------------------------------------------------------------------------
# recipe validation and an adaptive run through the engine
# ------------------------------------------------------------------------------------------


class TinyAdaptive(Algorithm):
    """Full-batch noisy GD whose noise is set from the previous noisy gradient norm (adaptive)."""

    name = "tiny_adaptive_test"
    adaptive = True
    defaults = {
        "sampler": {"name": "full_batch"},
        "estimator": {"name": "per_example_grad"},
        "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0},
        "update": {"name": "sgd", "lr": 0.1},
        "accountant": {"name": "zcdp"},
    }

    @dataclass
    class State:
        last_norm: float = 1.0

    def plan(self, ctx, noise_multiplier):
        return []

    def total_steps(self, ctx):
        return 10_000  # the filter decides when to stop

    def step(self, run):
        total = run.privatize_batch(run.sampler.indices(run.ctx))
        std = run.privatizer.cfg.clip * (2.0 + 4.0 / (1.0 + self.state.last_norm))  # from a release: public
        release = run.privatizer.release(total, run.ctx, std=std)
        run.charge(release.events)
        self.state.last_norm = float(sum(t.norm() ** 2 for t in release.value.tensors.values()) ** 0.5)
        run.update_rule.apply(run.params, release, run.ctx)
        return StepResult(run.step_metrics(total, release))


class _TestPlugin:
    @hookimpl
    def dpreg_register_algorithms(self, register):
        register(TinyAdaptive)


@pytest.fixture(scope="module")
def registry():
    from dpregistry.registry import Registry

    reg = Registry().load_entry_points()
    reg.add_plugin(_TestPlugin(), origin="tests (tiny adaptive)")
    return reg


def _adaptive_recipe(accountant, privacy):
    return {"algorithm": "tiny_adaptive_test",
            "objective": {"name": "quadratic", "dim": 3, "n": 100, "n_test": 10},
            "accountant": accountant, "privacy": privacy, "train": {"steps": 1, "progress": False}}


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_non_filter_accountants_are_refused_for_adaptive_algorithms(accountant, registry, tmp_path):
    from dpregistry.recipe import load

    path = write_recipe(tmp_path, _adaptive_recipe(accountant, {"epsilon": 1.0, "delta": 1e-5}))
    with pytest.raises(UserError) as e:
        load(path, registry=registry)
    assert "privacy filter" in e.value.message and "zcdp" in e.value.message
    assert e.value.key == "accountant.name" and e.value.file == str(path)


@pytest.mark.parametrize("accountant,privacy", [("zcdp", {"rho": 2.0}),
                                                ("rdp_filter", {"epsilon": 8.0, "delta": 1e-5})])
def test_adaptive_run_stops_cleanly_when_the_filter_refuses(accountant, privacy, registry, tmp_path):
    from dpregistry.run import Run
    from dpregistry.recipe import load

    recipe = _adaptive_recipe(accountant, privacy)
    recipe["train"]["steps"] = 10_000
    run = Run(load(write_recipe(tmp_path, recipe), registry=registry)).prepare()
    before = {k: v.clone() for k, v in run.params.items()}
    summary = run.train()
    assert summary["stopped"] and "privacy budget exhausted" in summary["stopped"]
    assert 5 < run.step < 10_000 and run.accountant.ledger.n_charges == run.step
    acc = run.accountant
    if accountant == "zcdp":
        assert acc.rho() <= 2.0
        assert acc.rho() + acc.remaining() == pytest.approx(2.0)
        # less than the refused step costs: why it stopped. (That step's σ came from the last
        # release, so with secret noise the point of stopping varies; ρ = Δ²/2σ², Δ = 2C.)
        refused_std = 2.0 + 4.0 / (1.0 + run.algorithm.state.last_norm)
        assert acc.remaining() < 2 / refused_std ** 2
    else:
        assert acc.epsilon() <= 8.0
    assert any(not torch.equal(before[k], run.params[k]) for k in before)


@pytest.mark.parametrize("privacy", [{}, {"delta": 1e-5}])
def test_an_adaptive_run_without_a_budget_is_refused(privacy, registry, tmp_path):
    """A filter's guarantee holds for a budget fixed in advance; the sum of adaptively chosen
    costs is not a guarantee (Rogers et al. 2016: odometers cost more), so without a budget an
    adaptive run would be admitted without limit and report an invalid ε."""
    from dpregistry.run import Run
    from dpregistry.recipe import load

    recipe = _adaptive_recipe("zcdp", privacy)
    with pytest.raises(UserError, match="budget") as e:
        Run(load(write_recipe(tmp_path, recipe), registry=registry)).prepare()
    assert e.value.key and e.value.key.startswith("privacy")


def test_rdp_filter_without_an_epsilon_is_refused_before_step_1(tmp_path):
    """Its budget (and order) come from (ε, δ): without ε the run failed at its first logged ε or at
    its summary, after steps were charged."""
    recipe = {"algorithm": "dp_sgd", "objective": {"name": "quadratic", "dim": 3, "n": 500, "n_test": 10},
              "sampler": {"name": "poisson", "batch_size": 25}, "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
              "update": {"lr": 0.05}, "accountant": "rdp_filter", "privacy": {"delta": 1e-5},
              "train": {"steps": 4, "log_every": 2, "progress": False}}
    for accountant in ("rdp_filter", {"name": "rdp_filter", "order": 8.0}):
        with pytest.raises(UserError, match="rdp_filter needs privacy.epsilon"):
            make_run({**recipe, "accountant": accountant}, tmp_path)
    recipe["privacy"]["epsilon"] = 50.0
    run = make_run(recipe, tmp_path)
    run.train()
    assert run.accountant.ledger.n_charges == 4 and 0 < run.epsilon() <= 50.0
