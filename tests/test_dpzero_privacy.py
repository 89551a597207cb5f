"""DPZero calibration: Lemma 2.2 (spec §8 A), the experiments' RDP multipliers (§8 B),
independence from u and d (§8 I) and the theorem calculators (§8 H)."""

from __future__ import annotations

import math

import pytest

from conftest import make_run
from dpreg_dpzero.accountant import (KovAdvancedComposition, kov_delta, kov_epsilon, kov_noise_multiplier,
                                     kov_sigma)
from dpreg_dpzero.theory import params_theorem1, params_theorem2, params_theorem3
from dpregistry import Budget, Charge
from dpregistry.errors import UserError
from dpregistry.privacy.events import (Composed, Gaussian, NonPrivate, PoissonSampled, SampledWithoutReplacement,
                                       SelfComposed)

# ------------------------------------------------------------------------------------------
# §8 A: Lemma 2.2
# ------------------------------------------------------------------------------------------

SPEC_A = [  # (C, n, T, ε, δ, σ) — spec §8 A [computed]
    (1, 10_000, 1_000, 2, 1e-6, 0.0340689408),
    (1, 10_000, 100, 2, 1e-6, 0.0107735450),
    (200, 1024, 10_000, 2, 1e-5, 193.00264),
    (200, 1024, 10_000, 6, 1e-5, 67.16703),
]


@pytest.mark.parametrize("C,n,T,eps,delta,sigma", SPEC_A)
def test_lemma_2_2_reference_values(C, n, T, eps, delta, sigma):
    assert kov_sigma(C, n, T, eps, delta) == pytest.approx(sigma, rel=1e-7)  # spec digits are rounded
    # the formula itself, independently: σ = 4C·sqrt(2T·log(e+ε/δ))/(nε)
    assert kov_sigma(C, n, T, eps, delta) == pytest.approx(
        4 * C * math.sqrt(2 * T * math.log(math.e + eps / delta)) / (n * eps), rel=1e-12)
    assert math.log(math.e + 2 / 1e-6) == pytest.approx(14.5086590977, rel=1e-10)


def test_lemma_2_2_scaling_and_inverse():
    base = kov_sigma(1, 10_000, 1_000, 2, 1e-6)
    assert kov_sigma(3, 10_000, 1_000, 2, 1e-6) == pytest.approx(3 * base, rel=1e-12)      # linear in C
    assert kov_sigma(1, 10_000, 4_000, 2, 1e-6) == pytest.approx(2 * base, rel=1e-12)      # ∝ √T
    assert kov_sigma(1, 20_000, 1_000, 2, 1e-6) == pytest.approx(base / 2, rel=1e-12)      # ∝ 1/n
    for T, eps, delta in [(1, 0.5, 1e-5), (1000, 2, 1e-6), (10_000, 6, 1e-5), (20_000, 0.1, 1e-9)]:
        m = kov_noise_multiplier(T, eps, delta)
        assert kov_epsilon(m, T, delta) == pytest.approx(eps, rel=1e-12)   # round trip (σ → ε)
        assert kov_delta(m, T, eps) == pytest.approx(delta, rel=1e-9)     # round trip (σ, ε → δ)
        assert kov_epsilon(m * 1.01, T, delta) < eps                       # more noise, less ε


def _acc(cls, epsilon=None, delta=1e-6):
    acc = cls()
    acc.bind(Budget(epsilon=epsilon, delta=delta, relation="replace_one"))
    return acc


@pytest.mark.parametrize("T,m", [(1, 5.0), (100, 20.0), (1000, 170.0), (1000, 40.0)])
def test_lemma_2_2_upper_bounds_the_tight_pld(T, m):
    """The closed form is a valid (loose) bound: a tight PLD accounting of the same Gaussian steps
    never certifies a larger ε."""
    from dpreg_accounting.accountants import PldAccountant

    plan = [Charge(Gaussian(std=m * 2.0, sensitivity=2.0), count=T)]
    kov = _acc(KovAdvancedComposition).epsilon(extra=plan)
    pld = _acc(PldAccountant).epsilon(extra=plan)
    assert kov == pytest.approx(kov_epsilon(m, T, 1e-6), rel=1e-12)
    assert pld <= kov


def _exact_gaussian_delta(epsilon, mu):
    """δ(ε) of μ-GDP (Balle & Wang 2018), which T Gaussian steps at σ/Δ = m compose to exactly,
    μ = √T/m (Dong, Roth & Su 2019), also adaptively."""
    from scipy.stats import norm

    return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2)))


@pytest.mark.parametrize("T,eps,delta", [(100, 300.0, 1e-5), (1000, 250.0, 1e-5), (1, 1000.0, 1e-6)])
def test_lemma_2_2_as_printed_fails_for_large_epsilon_and_is_never_certified(T, eps, delta):
    """Lemma 2.2's σ does not give (ε, δ)-DP for large ε (its μ = ε/(2√(2·log(e+ε/δ))) grows
    linearly in ε). The tight PLD accounting and the exact Gaussian composition both say so;
    the accountant must never certify such an (ε, δ) (nor report an ε below the true one)."""
    from dpreg_accounting.accountants import PldAccountant

    m = kov_noise_multiplier(T, eps, delta)
    mu = math.sqrt(T) / m
    assert _exact_gaussian_delta(eps, mu) > 10 * delta          # the Lemma's noise is not enough
    plan = [Charge(Gaussian(std=2 * m, sensitivity=2.0), count=T)]
    acc = _acc(KovAdvancedComposition, epsilon=eps, delta=delta)
    assert not acc.fits(plan)
    reported = acc.epsilon(extra=plan)
    assert _exact_gaussian_delta(reported, mu) <= delta * (1 + 1e-6)
    assert kov_delta(m, T, eps) >= _exact_gaussian_delta(eps, mu)
    if T == 100:  # an independent tight accountant (dp-accounting's PLD) agrees
        pld = _acc(PldAccountant).epsilon(delta=delta, extra=plan)
        assert pld > 1.3 * eps
        assert reported == pytest.approx(pld, rel=0.01)
    # calibrating to such a budget adds enough noise for the exact bound (std = z·C, Δ = 2C)
    z = acc.calibrate(lambda z: [Charge(Gaussian(std=z, sensitivity=2.0), count=T)])
    assert _exact_gaussian_delta(eps, math.sqrt(T) / (z / 2)) <= delta * (1 + 1e-6)


def test_kov_accountant_composes_conservatively():
    acc = _acc(KovAdvancedComposition, epsilon=2.0)
    m = kov_noise_multiplier(100, 2.0, 1e-6)
    g = Gaussian(std=2 * m, sensitivity=2.0)
    assert acc.fits([Charge(g, count=100)]) and not acc.fits([Charge(g, count=101)])
    # Poisson sampling is charged without amplification (valid, conservative)
    assert acc.epsilon(extra=[Charge(PoissonSampled(0.01, g), count=100)]) == pytest.approx(2.0, rel=1e-9)
    # mixed noise is charged at the smallest multiplier
    weak = Gaussian(std=m, sensitivity=2.0)
    assert acc.epsilon(extra=[Charge(g, count=50), Charge(weak, count=50)]) == pytest.approx(
        kov_epsilon(m / 2, 100, 1e-6), rel=1e-12)
    assert acc.epsilon(extra=[Charge(NonPrivate())]) == math.inf
    # T counts every Gaussian in a composition: 10 × (g + 9 sampled g) is the 100 steps above
    nested = Composed((g, SelfComposed(PoissonSampled(0.01, g), 9)))
    assert acc.epsilon(extra=[Charge(nested, count=10)]) == pytest.approx(2.0, rel=1e-9)
    assert acc.fits([Charge(nested, count=10)]) and not acc.fits([Charge(nested, count=10), Charge(g)])
    # a mechanism Lemma 2.2 says nothing about is refused, wherever it sits in the tree
    with pytest.raises(UserError, match="cannot account 'sampled_without_replacement'"):
        acc.epsilon(extra=[Charge(Composed((g, SampledWithoutReplacement(1000, 10, g))))])


def _quadratic(tmp_path, algorithm, *, n, dim=4, steps, clip, epsilon, delta, sampler=None, direction=None,
               accountant=None):
    r = {"algorithm": algorithm,
         "objective": {"name": "quadratic", "dim": dim, "n": n, "n_test": 100},
         "privatizer": {"clip": clip, "noise_multiplier": "auto"},
         "privacy": {"epsilon": epsilon, "delta": delta}, "train": {"steps": steps}}
    if sampler:
        r["sampler"] = sampler
    if direction:
        r["estimator"] = {"direction": direction}
    if accountant:
        r["accountant"] = accountant
    return make_run(r, tmp_path)


@pytest.mark.parametrize("algorithm", ["dpzero_full_batch", "dpgd_0th"])
def test_run_noise_is_lemma_2_2(tmp_path, algorithm):
    """A full-batch run calibrated by kov_advanced_composition adds exactly σ of §8 A to the mean,
    for Alg. 2 and Alg. 1 alike (the accountant does not depend on the estimator)."""
    run = _quadratic(tmp_path, algorithm, n=10_000, steps=1_000, clip=1.0, epsilon=2.0, delta=1e-6)
    std_on_mean = run.privatizer.noise_multiplier * 1.0 / run.sampler.expected_batch_size(run.ctx)
    assert std_on_mean == pytest.approx(0.0340689408, rel=1e-9)
    plan = run.algorithm.plan(run.ctx, run.privatizer.noise_multiplier)
    assert run.accountant.epsilon(extra=plan) == pytest.approx(2.0, rel=1e-9)
    assert run.accountant.epsilon(extra=plan) <= 2.0 * (1 + 1e-12)


# ------------------------------------------------------------------------------------------
# §8 B: the experiments' RDP multipliers (std = 2·m·C/B on the mean)
# ------------------------------------------------------------------------------------------

SPEC_B = [  # (n, ε, Opacus-1.4 m) — spec §4.2 table, B = 64, T = 10,000, δ = 1e-5
    (1024, 2, 13.5156), (1024, 6, 5.1562), (2560, 2, 5.4492), (2560, 6, 2.1680),
    (1536, 6, 3.4814), (3072, 2, 4.5703),
]


@pytest.mark.parametrize("n,eps,m", SPEC_B)
def test_rdp_multipliers_match_the_dpzero_code(tmp_path, n, eps, m):
    run = _quadratic(tmp_path, "dpzero", n=n, steps=10_000, clip=200.0, epsilon=eps, delta=1e-5)
    z = run.privatizer.noise_multiplier          # std on the clipped sum ÷ C (sensitivity 2C)
    assert z / 2 == pytest.approx(m, rel=5e-3)   # Opacus's add/remove multiplier m, ±0.5 %
    plan = run.algorithm.plan(run.ctx, z)
    achieved = run.accountant.epsilon(extra=plan)
    assert eps - 0.01 <= achieved <= eps
    std_on_mean = z * 200.0 / run.sampler.expected_batch_size(run.ctx)
    assert std_on_mean == pytest.approx(2 * m * 200.0 / 64, rel=5e-3)
    if (n, eps) == (1024, 6):
        assert std_on_mean == pytest.approx(32.2, abs=0.05)   # the spec's SST-2 example


# ------------------------------------------------------------------------------------------
# §8 I: privacy does not depend on u or d
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["kov_advanced_composition", "rdp"])
def test_calibration_ignores_direction_and_dimension(tmp_path, accountant):
    zs = set()
    for dim in (3, 50):
        for direction in ("sphere", "gaussian", "rademacher"):
            sub = tmp_path / f"{dim}{direction}"
            sub.mkdir()
            run = _quadratic(sub, "dpzero", n=2000, dim=dim, steps=200, clip=1.0, epsilon=2.0, delta=1e-5,
                             direction=direction, accountant=accountant)
            zs.add(run.privatizer.noise_multiplier)
    assert len(zs) == 1


# ------------------------------------------------------------------------------------------
# §8 H: theorem calculators
# ------------------------------------------------------------------------------------------


def test_theorem_3_reference_values():
    p = params_theorem3(10_000, 1_000, 10, 2.0, 1e-6, 1.0, 1.0)
    assert p.L_tilde == pytest.approx(5.919859, rel=1e-6)
    assert p.clip == pytest.approx(23.679437, rel=1e-6)
    assert p.alpha == pytest.approx(1 / 48, rel=1e-12)
    assert p.steps == pytest.approx(4981.2417, rel=1e-6)
    assert p.lambda_max == pytest.approx(7.760538e-7, rel=1e-6)
    assert p.sigma == pytest.approx(1.800524, rel=1e-6)
    q = params_theorem3(10_000, 100, 10, 2.0, 1e-6, 1.0, 1.0)
    assert (q.L_tilde, q.clip, q.steps, q.lambda_max) == pytest.approx((5.722075, 22.888302, 4981.2417, 2.454098e-5),
                                                                       rel=1e-6)


def test_theorems_1_and_2_reference_values():
    p1 = params_theorem1(10_000, 100, None, 2.0, 1e-6, 1.0, 1.0)
    assert (p1.alpha, p1.steps, p1.clip, p1.lambda_max) == pytest.approx((0.0025, 525.0690, 100, 1.745628e-3), rel=1e-6)
    p2 = params_theorem2(10_000, 100, 10, 2.0, 1e-6, 1.0, 1.0)
    assert (p2.alpha, p2.steps, p2.clip, p2.lambda_max) == pytest.approx((1 / 48, 199.2497, 100, 9.816390e-4),
                                                                         rel=1e-6)
    # σ(C, T) is Lemma 2.2 at the theorem's own (C, T)
    assert p2.sigma == pytest.approx(kov_sigma(100, 10_000, p2.steps, 2.0, 1e-6), rel=1e-12)
    with pytest.raises(ValueError):
        params_theorem2(10_000, 100, 200, 2.0, 1e-6)  # r > d


def test_accountant_without_budget_records_charges():
    """Core change: with no (ε, δ) or ρ target nothing is enforced, but the ledger still records."""
    from dpreg_accounting.accountants import RdpAccountant

    acc = RdpAccountant()
    acc.bind(Budget(relation="replace_one"))
    acc.charge([Charge(NonPrivate()), Charge(Gaussian(std=2.0, sensitivity=2.0))], step=0)
    assert acc.ledger.n_charges == 2
    acc.bind(Budget(epsilon=1.0, delta=1e-5))
    assert not acc.can_afford([Charge(NonPrivate())])    # with a budget, a non-private release is refused


@pytest.mark.parametrize("d, m", [(8, 12), (64, 64)])
def test_a_vector_zo_row_whose_lift_cancels_is_clipped_by_its_lift(d, m):
    """DPGD-0th's rows are m coefficients on m public directions. A row of 10¹⁵ in the null space
    of the directions (m > d), or along their weakest one (m = d), lifts to almost nothing, and its
    fp32 Gram norm came out 0 or 2 % low: unclipped, its fp32 lift moved the sum by 1.4·10⁸·C, or
    1.02·C (a review). The norm is now an upper bound in float64 and the lift is float64."""
    import torch

    from dpregistry.clipping import clip_and_sum
    from dpregistry.directions import Direction
    from dpregistry.spaces import VectorZOContribution

    params, C = {"w": torch.zeros(d)}, 1.0
    dirs = tuple(Direction(1000 + j) for j in range(m))
    U = torch.stack([u.flatten() for dr in dirs for u in dr.dense(list(params.values()), dtype=torch.float64)])
    left, _, _ = torch.linalg.svd(U, full_matrices=True)
    g = torch.Generator().manual_seed(0)
    others = torch.randn(3, m, generator=g, dtype=torch.float64) * 0.1

    def released(values):
        c = VectorZOContribution(values=values.float(), directions=dirs, params=params)
        return clip_and_sum(c, C).aggregate.tensors["w"].double()

    without, worst = released(others), 0.0
    for _ in range(6):
        coef = torch.randn(m, generator=g, dtype=torch.float64)
        row = left[:, d:] @ coef[d:] if m > d else left[:, -1] * coef[0]
        worst = max(worst, float((released(torch.cat([others, (row / row.norm() * 1e15)[None]])) - without).norm()))
    assert worst <= C
