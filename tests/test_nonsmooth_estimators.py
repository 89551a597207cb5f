"""Zeroth- and first-order oracles: unbiasedness, exact cases, variance and sensitivity bounds."""

from __future__ import annotations

import math

import pytest
import torch

from dpreg_nonsmooth.estimators import concentration_radius
from dpreg_nonsmooth.points import PointQuery, ball
from dpreg_ztc import theory as ztc
from nonsmooth_helpers import Stub, host, per_example

N = 20_000  # slots (independent direction draws) per Monte-Carlo estimate


def _same_record(n):
    return torch.zeros(n, dtype=torch.long)


def test_quadratic_grad_and_diff_are_unbiased(tmp_path):
    """Spec 001 §5.1 on ½‖x − x_i‖² (the baseline quadratic, queried through torch.func.vmap):
    ∇f_δ(x) = x − x_i exactly, so mean GRAD → x − x_i and mean DIFF(x, y) → x − y."""
    run = host(tmp_path, objective={"name": "quadratic", "dim": 4, "n": 50, "hessian": "identity"},
               estimator={"privacy_mode": "clip", "lipschitz": 100.0})
    assert not run.estimator.query.native  # the generic vmap path
    xi = run.objective.data[0]
    x = torch.tensor([0.3, -0.2, 0.5, 1.0], dtype=torch.float64)
    y = x + torch.tensor([0.05, 0.1, -0.1, 0.02], dtype=torch.float64)
    n = 4000  # the vmap path is slower than the native one
    g, _ = per_example(run, x, _same_record(n))
    se = g.std(0) / math.sqrt(n)
    assert torch.all((g.mean(0) - (x - xi)).abs() <= 4 * se + 1e-9)
    dlt, c = per_example(run, x, _same_record(n), prev=y, step=1)
    se = dlt.std(0) / math.sqrt(n)
    assert torch.all((dlt.mean(0) - (x - y)).abs() <= 4 * se + 1e-9)
    assert c.info["fresh"] is False and c.kind == "increment"


@pytest.mark.parametrize("m", [1, 7])
def test_abs_in_one_dimension_is_deterministic(tmp_path, m):
    """Spec 001 §5.2 / spec 002 §7.4: d = 1, f = |x|: U_S = {±1}, GRAD = clip(x/δ, −1, 1) for every draw."""
    for mode in ("coupled_one_sided", "independent_central"):
        run = host(tmp_path, objective={"name": "l1_distance", "dim": 1, "n": 10, "noise_std": 0.0},
                   estimator={"smooth_radius": 0.5, "dirs_per_sample": m, "diff_mode": mode})
        for x, want in [(-0.3, -0.6), (0.1, 0.2), (0.9, 1.0), (-2.0, -1.0)]:
            g, _ = per_example(run, torch.tensor([x], dtype=torch.float64), torch.arange(10))
            assert torch.allclose(g, torch.full_like(g, want), atol=1e-12, rtol=0)


def test_norm_matches_first_order_reference(tmp_path):
    """Spec 001 §5.3: f = ‖x‖₂, d = 6, δ = 0.2, x = 0.1e₁: E GRAD = E_{v∼U_B} ∇f(x + δv) ≈ 0.464."""
    run = host(tmp_path, dim=6, objective={"name": "ring", "dim": 6, "n": 10, "radius": 0.0, "noise_std": 0.0},
               estimator={"smooth_radius": 0.2})
    x = torch.zeros(6, dtype=torch.float64)
    x[0] = 0.1
    g, _ = per_example(run, x, _same_record(N))
    v = ball(torch.Generator().manual_seed(7), 400_000, 6, 0.2)
    ref = ((x + v) / (x + v).norm(dim=1, keepdim=True)).mean(0)
    assert float(ref[0]) == pytest.approx(0.464, abs=0.005)
    se = g.std(0) / math.sqrt(N)
    assert torch.all((g.mean(0) - ref).abs() <= 4 * se + 2e-3)


def test_linear_terms_mean_and_exact_variance(tmp_path):
    """Spec 001 §5.4 / spec 002 §7.5: f = <a, x>: every term is d<a,u>u, E GRAD = a, E DIFF = 0, and
    E‖GRAD − a‖² = (d − 1)‖a‖²/m exactly (d = 7, m = 4: 3.859 for the spec's a)."""
    d, m = 7, 4
    a = torch.tensor([1.0, -0.5, 0.25, 0.0, 0.7, -0.3, 0.2], dtype=torch.float64)
    stub = Stub(lambda p, z: p @ a)
    run = host(tmp_path, dim=d, estimator={"dirs_per_sample": m, "smooth_radius": 0.3})
    q = PointQuery(stub, run.estimator.view)
    x = torch.linspace(-1, 1, d, dtype=torch.float64)
    g, _ = per_example(run, x, _same_record(N), query=q)
    assert torch.allclose(g.mean(0), a, atol=4 * float(g.std(0).max()) / math.sqrt(N))
    var = float((g - a).pow(2).sum(1).mean())
    assert var == pytest.approx((d - 1) * float(a @ a) / m, rel=0.03)
    run1 = host(tmp_path, dim=d, estimator={"dirs_per_sample": 1, "smooth_radius": 0.3})
    g1, _ = per_example(run1, x, _same_record(2000), query=PointQuery(stub, run1.estimator.view))
    # one term is d<a,u>u with ‖u‖ = 1: ‖term‖² = d²<a,u>² = d·<term, a>
    assert torch.allclose(g1.pow(2).sum(1), d * (g1 @ a), rtol=1e-9, atol=1e-12)
    y = x + 0.05
    dl, _ = per_example(run, x, _same_record(N), prev=y, step=1, query=q)
    assert torch.allclose(dl.mean(0), torch.zeros(d, dtype=torch.float64), atol=4 * float(dl.std(0).max()) / math.sqrt(N))


def test_variance_and_per_term_bounds_on_l1(tmp_path):
    """Spec 001 §5.5–6 on ‖x − z‖₁/√d (L = 1, d = 6): E‖GRAD − mean‖² ≤ 16dL²/b,
    E‖DIFF − mean‖² ≤ 16dL²‖x − y‖²/(bδ²); every single term has ‖g‖ ≤ dL, ‖d‖ ≤ dL‖x − y‖/δ."""
    d, delta = 6, 0.2
    run = host(tmp_path, dim=d, objective={"name": "l1_distance", "dim": d, "n": N},
               estimator={"smooth_radius": delta})
    x = torch.full((d,), 0.1, dtype=torch.float64)
    y = x + 0.3 * delta * torch.linspace(-1, 1, d, dtype=torch.float64) / math.sqrt(d)
    gap = float((x - y).norm())
    idx = torch.arange(N)
    g, _ = per_example(run, x, idx)
    assert float((g - g.mean(0)).pow(2).sum(1).mean()) <= 16 * d
    dl, _ = per_example(run, x, idx, prev=y, step=1)
    assert float((dl - dl.mean(0)).pow(2).sum(1).mean()) <= 16 * d * gap ** 2 / delta ** 2
    single = host(tmp_path, dim=d, objective={"name": "l1_distance", "dim": d, "n": N},
                  estimator={"smooth_radius": delta, "dirs_per_sample": 1})
    g1, c = per_example(single, x, idx)
    assert float(g1.norm(dim=1).max()) <= d * (1 + 1e-12)
    assert c.info["bound"] == pytest.approx(d)
    d1, c = per_example(single, x, idx, prev=y, step=1)
    assert float(d1.norm(dim=1).max()) <= d * gap / delta * (1 + 1e-12)
    assert c.info["bound"] == pytest.approx(d * gap / delta)


def test_replace_one_sensitivity_and_tightness(tmp_path):
    """Spec 001 §5.6: with shared directions, neighbouring batches give ‖GRAD(Z) − GRAD(Z')‖ ≤ 2dL/b;
    d = 1, f = L·z·x with z ∈ {−1, +1} reaches 2dL/b exactly."""
    L, b = 1.5, 8
    data = torch.tensor([1.0] * b + [-1.0], dtype=torch.float64)  # record b is the replacement
    stub = Stub(lambda p, z: L * z * p[:, 0], data=data)
    run = host(tmp_path, dim=1, objective={"name": "l1_distance", "dim": 1, "n": 20},
               estimator={"lipschitz": L, "dirs_per_sample": 3})
    q = PointQuery(stub, run.estimator.view)
    x = torch.tensor([0.4], dtype=torch.float64)
    batch = torch.arange(b)
    nb = batch.clone()
    nb[3] = b  # replace one record
    g, _ = per_example(run, x, batch, query=q)
    g2, _ = per_example(run, x, nb, query=q)
    diff = float((g.mean(0) - g2.mean(0)).norm())
    assert diff == pytest.approx(2 * 1 * L / b, rel=1e-12)
    assert run.privatizer.sensitivities()["fresh"] == pytest.approx(2 * 1 * L / run.algorithm.settings.batch_first)


def test_tree_sensitivity_matches_closed_form_and_ignores_m(tmp_path):
    """The charged element sensitivity is max(2dL/B1, 4dLD/(B2δ)) (spec 001 §2.2), whatever m is (§5.7)."""
    sens = []
    for m in (1, 5, 40):
        run = host(tmp_path, dim=5, algorithm={"name": "ztc_o2nc_tree", "episode_len": 20},
                   estimator={"dirs_per_sample": m, "smooth_radius": 0.1}, update={"radius": "auto", "window": "auto"})
        s = run.algorithm.settings
        sens.append(run.privatizer.element_sensitivity())
        assert sens[-1] == pytest.approx(ztc.element_sensitivity(5, 1.0, 0.1, s.radius, s.batch_first, s.batch_rest))
        assert (s.batch_first, s.batch_rest, s.radius) == (21, 1, pytest.approx(0.1 / 20))
    assert sens[0] == sens[1] == sens[2]


def _marginal_cdf(d, t):
    """F_d(t) of the density ∝ (1 − u²)^((d−1)/2) on [−1, 1] (a coordinate of the uniform d-ball)."""
    u = torch.linspace(-1, 1, 200_001, dtype=torch.float64)
    dens = (1 - u * u).clamp_min(0) ** ((d - 1) / 2)
    cdf = torch.cumulative_trapezoid(dens, u)
    return float(cdf[int((t + 1) / 2 * 200_000) - 1] / cdf[-1])


def test_abs_of_linear_form_zo_and_fo_match_closed_form(tmp_path):
    """Spec 002 §7.6: f = |<w, x>|, ‖w‖ = 1: ∇f_α = w(2F_d(<w,x>/α) − 1) = 0.7343·w at d = 10, α = 0.3,
    <w,x> = 0.1. ZO on the sphere and FO on the ball match; ZO with the printed Unif(𝔹_α) directions
    (spec 002 [AMBIG-5]) is off by an order of magnitude (≈ 0.075)."""
    d, alpha = 10, 0.3
    w = torch.zeros(d, dtype=torch.float64)
    w[0] = 1.0
    exact = 2 * _marginal_cdf(d, 0.1 / alpha) - 1
    assert exact == pytest.approx(0.7343, abs=5e-4)
    stub = Stub(lambda p, z: (p @ w).abs(), lambda p, z: torch.sign(p @ w).unsqueeze(1) * w)
    x = 0.1 * w
    zo = host(tmp_path, dim=d, estimator={"smooth_radius": alpha, "dirs_per_sample": 4})
    g, _ = per_example(zo, x, _same_record(N), query=PointQuery(stub, zo.estimator.view))
    assert float(g.mean(0)[0]) == pytest.approx(exact, abs=4 * float(g[:, 0].std()) / math.sqrt(N))
    fo = host(tmp_path, dim=d, algorithm={"name": "klt_sp_fo", "vr_period": 4},
              estimator={"smooth_radius": alpha, "dirs_per_sample": 4, "perturbations_fresh": 4,
                         "delta_fail": 0.0})
    gf, _ = per_example(fo, x, _same_record(N), query=PointQuery(stub, fo.estimator.view))
    assert float(gf.mean(0)[0]) == pytest.approx(exact, abs=4 * float(gf[:, 0].std()) / math.sqrt(N))
    # the printed VR directions: y ~ Unif(𝔹_α) in the sphere formula
    y = ball(torch.Generator().manual_seed(3), 50_000, d, alpha)
    lit = (d / (2 * alpha)) * (stub.f(x + alpha * y, None) - stub.f(x - alpha * y, None)).unsqueeze(1) * y
    assert abs(float(lit.mean(0)[0]) - exact) > 0.5


def test_first_order_perturbation_counts_and_independence(tmp_path):
    """Spec 002 §7.8: a fresh FO step uses one perturbation per record; a VR step 2m, split m/m between
    z_t and z_(t−1), independently, so the increment has variance even at z_t = z_(t−1)."""
    d, m, B = 3, 5, 4
    stub = Stub(lambda p, z: p.abs().sum(1), lambda p, z: torch.sign(p))
    run = host(tmp_path, dim=d, algorithm={"name": "klt_sp_fo", "vr_period": 4},
               estimator={"smooth_radius": 0.3, "dirs_per_sample": m, "delta_fail": 0.0})
    q = PointQuery(stub, run.estimator.view)
    x = torch.full((d,), 0.05, dtype=torch.float64)
    per_example(run, x, torch.arange(B), query=q)
    assert [n for k, n in stub.calls if k == "grad"] == [B]
    stub.calls.clear()
    inc, c = per_example(run, x, torch.arange(B), prev=x, step=1, query=q)
    assert [n for k, n in stub.calls if k == "grad"] == [m * B, m * B]
    assert float(inc.abs().sum()) > 0 and c.info["fresh"] is False


def test_klt_high_probability_bound_holds_at_the_promised_rate(tmp_path):
    """Spec 002 §7.15: per-example ZO estimates stay within L + r_m (the fresh hp bound) in at least a
    1 − δ_fail fraction of draws; with privacy_mode: clip γ is not charged (both modes clip at R)."""
    d, m, gamma = 3, 200, 0.05
    run = host(tmp_path, dim=d, objective={"name": "l1_distance", "dim": d, "n": 4000},
               algorithm={"name": "klt_sp_zo", "vr_period": 4},
               estimator={"dirs_per_sample": m, "delta_fail": gamma, "smooth_radius": 0.2})
    R, g = run.estimator.public_bound(True, 0.0)
    r = concentration_radius(d + 1, m, gamma)
    assert (R, g) == (pytest.approx(1 + r), gamma) and R < d  # the hp bound beats dL here
    x = torch.full((d,), 0.3, dtype=torch.float64)
    est, _ = per_example(run, x, torch.arange(2000))
    assert float((est.norm(dim=1) > R).float().mean()) <= gamma
    clip = host(tmp_path, dim=d, objective={"name": "l1_distance", "dim": d, "n": 4000},
                algorithm={"name": "klt_sp_zo", "vr_period": 4},
                estimator={"dirs_per_sample": m, "delta_fail": gamma, "smooth_radius": 0.2, "privacy_mode": "clip"})
    assert clip.estimator.public_bound(True, 0.0) == (pytest.approx(R), 0.0)
    _, c = per_example(clip, x, torch.arange(2000))
    total = clip.privatizer.clip_sum(c)
    assert total.count == 2000 and total.clipped == int((c.norms() > R * (1 + 1e-6)).sum())
    # paper mode clips at its bound too (a safety net: the clip binds only where the bound fails)
    _, p = per_example(run, x, torch.arange(2000))
    assert run.privatizer.clip_sum(p).clipped == int((est.norm(dim=1) > R * (1 + 1e-6)).sum())


@pytest.mark.parametrize("estimator", [{"name": "zo_sphere", "dirs_per_sample": 200},
                                       {"name": "fo_ball", "dirs_per_sample": 200}])
def test_high_probability_bounds_draw_their_directions_from_secret_randomness(tmp_path, monkeypatch, estimator):
    """Spec 002 §2.2/§2.5: KLT's high-probability sensitivity fails with probability γ over the
    mechanism's own directions, and δ_fail charges exactly that. Directions that are a function of the
    public seed (a recipe's `seed: 0`) are no randomness to whoever chooses the data: a record can be
    built against them, and the bound fails for sure. So in paper mode with γ > 0 the directions come
    from the secret noise key, while worst-case bounds (γ = 0, or privacy_mode: clip, which enforces
    them) keep public directions that replicas and replays regenerate from the seed."""
    d, x = 3, torch.full((3,), 0.3, dtype=torch.float64)

    keys = {"a": "3f1c9a7be2d54c6a8b0e1f2a3c4d5e6f", "b": "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d"}

    def estimates(key, step, **over):
        monkeypatch.setenv("DPREG_NOISE_KEY", keys[key])
        run = host(tmp_path, dim=d, objective={"name": "ring", "dim": d, "n": 400, "noise": "linear"},
                   algorithm={"name": "klt_sp_zo", "vr_period": 4},
                   estimator={**estimator, "smooth_radius": 0.2, "lipschitz": 1.1, **over},
                   privacy={"noise": "keyed"})
        prev = None if step == 0 else x - 0.01
        est, c = per_example(run, x, torch.arange(8), prev=prev, step=step)
        return est, c.info["gamma"]

    for step in (0, 1):  # the fresh estimate and the variance-reduced increment
        a, gamma = estimates("a", step, delta_fail=0.05)
        # the high-probability bound is charged, except for fo_ball's fresh step (deterministic L)
        assert gamma == (0.0 if step == 0 and estimator["name"] == "fo_ball" else 0.05)
        assert torch.equal(a, estimates("b", step, delta_fail=0.05)[0]) == (gamma == 0)
        assert torch.equal(a, estimates("a", step, delta_fail=0.05)[0])  # the key reproduces them
        for worst_case in ({"delta_fail": 0.0}, {"delta_fail": 0.05, "privacy_mode": "clip"}):
            a, gamma = estimates("a", step, **worst_case)
            assert gamma == 0.0 and torch.equal(a, estimates("b", step, **worst_case)[0])
