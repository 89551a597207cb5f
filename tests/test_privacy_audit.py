"""Empirical privacy audit of the real privatizer code path (clip_sum + release with a run's
secret noise source), on neighbouring batches that differ in one record (replace-one).

The audited lower bound on ε must never exceed the ε the accountant claims for the release's
events; a privatizer whose noise is 4× smaller than it declares must be caught.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_run
from dpregistry.audit import (audit, clopper_pearson_upper, epsilon_lower_bound, release_mechanism)
from dpregistry.privacy.accountant import make_accountant
from dpregistry.stages import Charge

DELTA = 1e-5
TRIALS = 6000  # per data set: seconds for all four audits below
CLIP = 1.0
Z = 3.0        # noise std / sensitivity of the audited releases


def _recipe(estimator: str, update: str) -> dict:
    return {
        "algorithm": "standard",
        "objective": {"name": "quadratic", "dim": 4, "n": 64, "n_test": 8},
        "sampler": {"name": "full_batch"},
        "estimator": estimator,
        "privatizer": {"name": "gaussian", "clip": CLIP, "noise_multiplier": 2 * Z},  # std = Z·(2C)
        "update": {"name": update, "lr": 0.01},
        "accountant": "pld",
        "privacy": {"epsilon": 50.0, "delta": DELTA},
        "train": {"steps": 1, "progress": False},
    }


class Quieter:
    """A deliberately broken privatizer: it adds 4× less noise than its events declare."""

    def __init__(self, privatizer):
        self.inner = privatizer

    def release(self, total, run, std=None):
        declared = self.inner.noise_multiplier * self.inner.cfg.clip
        rel = self.inner.release(total, run, std=declared / 4)
        rel.events = self.inner._events(declared)  # what a buggy privatizer would report
        return rel


def _claimed_epsilon(run, events) -> float:
    acc = make_accountant("pld", run.budget)
    return acc.epsilon(DELTA, extra=[Charge(e) for e in events])


def _neighbouring_totals(run, contrib, set_last):
    """clip_sum of the batch with its last record replaced by two opposite extremes."""
    return tuple(run.privatizer.clip_sum(set_last(contrib, sign)) for sign in (-1.0, 1.0))


def _dense_case(tmp_path):
    run = make_run(_recipe("per_example_grad", "sgd"), tmp_path)
    contrib = next(run.estimator.contributions(run.objective, torch.arange(16), run))

    def set_last(c, sign):
        g = {k: v.clone() for k, v in c.per_example.items()}
        g["x"][-1] = 0
        g["x"][-1, 0] = sign * 100.0  # clipped to ±C along the first axis: the two differ by 2C
        return type(c)(per_example=g, losses=c.losses)

    totals = _neighbouring_totals(run, contrib, set_last)
    diff = totals[1].aggregate.tensors["x"] - totals[0].aggregate.tensors["x"]
    assert float(diff.norm()) == pytest.approx(run.privatizer.sensitivity())  # the worst case
    unit = diff / diff.norm()
    return run, totals, lambda agg: float((agg.tensors["x"] * unit).sum())


def _scalar_case(tmp_path):
    run = make_run(_recipe("zo_two_point", "directional_sgd"), tmp_path)
    contrib = next(run.estimator.contributions(run.objective, torch.arange(16), run))
    run.undo_displacement()

    def set_last(c, sign):
        v = c.values.clone()
        v[-1] = sign * 100.0
        return type(c)(values=v, direction=c.direction, names=c.names, losses=c.losses)

    totals = _neighbouring_totals(run, contrib, set_last)
    assert totals[1].aggregate.coeff - totals[0].aggregate.coeff == pytest.approx(run.privatizer.sensitivity())
    return run, totals, lambda agg: agg.coeff


@pytest.mark.parametrize("case", [_dense_case, _scalar_case], ids=["dense", "seeded_direction"])
def test_audit_never_exceeds_claimed_epsilon_and_catches_4x_less_noise(case, tmp_path):
    run, totals, statistic = case(tmp_path)
    events = run.privatizer._events(run.privatizer.noise_multiplier * CLIP)
    claimed = _claimed_epsilon(run, events)
    assert 1.0 < claimed < 2.0  # a Gaussian of multiplier 3 at δ = 1e-5

    honest = audit(release_mechanism(run.privatizer, run, totals, statistic), TRIALS, DELTA)
    assert honest.epsilon_lower <= claimed
    assert honest.epsilon_lower > 0.1  # the audit has power: it sees the signal

    broken = Quieter(run.privatizer)
    caught = audit(release_mechanism(broken, run, totals, statistic), TRIALS, DELTA)
    assert caught.epsilon_lower > claimed


def test_clopper_pearson_matches_exact_binomial_tail():
    from scipy import stats

    for k, n in [(0, 100), (3, 1000), (50, 200)]:
        u = clopper_pearson_upper(k, n, 0.025)
        assert stats.binom.cdf(k, n, u) == pytest.approx(0.025, rel=1e-6)  # P(X <= k | p = u) = α
    assert clopper_pearson_upper(10, 10, 0.05) == 1.0


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
