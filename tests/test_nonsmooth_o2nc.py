"""The O2NC update rule: invariants (‖Δ‖ ≤ D, ‖w_{t+1} − w_t‖ ≤ 2D, restarts, windows) and progress."""

from __future__ import annotations

import math

import pytest
import torch

from dpregistry.spaces import DenseAggregate
from dpregistry.stages import Release

from conftest import make_run
from nonsmooth_helpers import host, recipe


def _drive(run):
    """Run every step by hand; record (x_t, Δ_t, w_t) before each step."""
    upd, view = run.update_rule, run.update_rule.view
    rows = []
    while not run.algorithm.done(run.begin_step()):
        rows.append((upd.state.x.clone(), upd.state.delta.clone(), view.flat(run.params)))
        run.algorithm.step(run)
        run.step += 1
    rows.append((upd.state.x.clone(), upd.state.delta.clone(), view.flat(run.params)))
    return rows


def test_ztc_invariants(tmp_path):
    """Spec 001 §5.13: ‖Δ‖ ≤ D always; Δ^k_1 = 0 and w^k_1 = x^k_1; x_{t+1} = x_t + Δ_t (so
    x^{k+1}_1 = x^k_{T+1}); ‖w_{t+1} − w_t‖ ≤ 2D; ‖w^k_t − w̄^k‖ ≤ TD = δ."""
    T, delta = 6, 0.3
    run = make_run(recipe({"name": "ztc_o2nc_tree", "episode_len": T},
                          {"name": "ring", "dim": 3, "n": 240, "noise_std": 0.1},
                          estimator={"smooth_radius": delta}, privatizer={"noise_multiplier": 0.0},
                          update={"lr": 5.0}), tmp_path)
    D = run.update_rule.D
    assert D == pytest.approx(delta / T) and run.update_rule.M == T and run.update_rule.restart == T
    rows = _drive(run)
    hit = 0
    for t, (x, dl, w) in enumerate(rows[:-1]):
        assert float(dl.norm()) <= D * (1 + 1e-9)
        hit += float(dl.norm()) > 0.999 * D
        if t % T == 0:
            assert float(dl.norm()) == 0 and torch.equal(w, x)
        x_next = rows[t + 1][0]
        assert torch.allclose(x_next, x + dl, rtol=0, atol=1e-15)
        assert float((rows[t + 1][2] - w).norm()) <= 2 * D * (1 + 1e-9)
    assert hit > len(rows) // 4  # the projection was active: the bounds were tested, not idle
    ws = torch.stack([r[2] for r in rows[:-1]])
    for k in range(len(ws) // T):
        ep = ws[k * T:(k + 1) * T]
        assert float((ep - ep.mean(0)).norm(dim=1).max()) <= T * D * (1 + 1e-9)


def test_klt_never_restarts_and_windows_are_independent_of_periods(tmp_path):
    """Spec 002 §7.9: Δ is not reset at period starts; ‖z − x̄_k‖ ≤ M·D in each window; z_1 = x_0;
    x_out ∈ 𝔹(x_0, D·T)."""
    run = make_run(recipe({"name": "klt_sp_zo", "vr_period": 4},
                          {"name": "ring", "dim": 3, "n": 400, "noise_std": 0.1},
                          estimator={"smooth_radius": 0.3, "dirs_per_sample": 4, "delta_fail": 0.0},
                          privatizer={"noise_multiplier": 0.0}, update={"lr": 5.0, "radius": 0.02, "window": 5},
                          train={"steps": 60, "log_every": 1000}), tmp_path)
    upd = run.update_rule
    x0 = upd.state.x.clone()
    rows = _drive(run)
    assert torch.equal(rows[0][2], x0)
    starts = [t for t in range(1, 60) if t % 4 == 0]
    assert any(float(rows[t][1].norm()) > 0 for t in starts)  # Δ carries over period starts
    ws = torch.stack([r[2] for r in rows[:-1]])
    for k in range(60 // 5):
        win = ws[k * 5:(k + 1) * 5]
        assert float((win - win.mean(0)).norm(dim=1).max()) <= 5 * 0.02 * (1 + 1e-9)
    out = run.update_rule.output(run.params, run.ctx)["x"]
    assert float((out - x0).norm()) <= 0.02 * 60
    k = run.update_rule.state.selected
    assert torch.allclose(out, ws[k * 5:(k + 1) * 5].mean(0))


def _feed(run, grad_fn, steps):
    """Drive the update rule alone with exact (noise-free) gradients as releases."""
    upd, view = run.update_rule, run.update_rule.view
    xs = []
    for t in range(steps):
        run.step = t
        w = view.flat(run.params)
        xs.append((upd.state.x.clone(), w))
        upd.apply(run.params, Release(DenseAggregate({"x": grad_fn(w)}), []), run.begin_step())
    return xs


def test_linear_objective_learner_saturates_and_descends(tmp_path):
    """Spec 002 §7.10: h = <c, x>, exact oracle: Δ_t → −D·c/‖c‖ within about D/(η‖c‖) steps, then
    h falls by D‖c‖ per step."""
    c = torch.tensor([0.6, -0.8, 0.0], dtype=torch.float64)
    D, eta = 0.01, 0.002
    run = host(tmp_path, dim=3, algorithm={"name": "klt_sp_zo", "vr_period": 4},
               estimator={"dirs_per_sample": 2, "delta_fail": 0.0},
               update={"radius": D, "lr": eta, "window": 1, "restart_every": "never"})
    xs = _feed(run, lambda w: c, 40)
    k = math.ceil(D / (eta * float(c.norm())))
    assert torch.allclose(run.update_rule.state.delta, -D * c / c.norm(), atol=1e-12)
    drops = [float(c @ (xs[t + 1][0] - xs[t][0])) for t in range(k + 1, 39)]
    assert drops == pytest.approx([-D * float(c.norm())] * len(drops), rel=1e-9)


def test_exact_gradients_decrease_a_smooth_quadratic_and_its_certificate(tmp_path):
    """Spec 001 §5.14: with σ = 0 and exact gradients, O2NC decreases F and the certificate."""
    target = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    run = host(tmp_path, dim=3, algorithm={"name": "ztc_o2nc_tree", "episode_len": 10},
               update={"radius": 0.02, "lr": 0.01, "window": 10, "restart_every": 10})
    F = lambda x: 0.5 * float((x - target).pow(2).sum())
    xs = _feed(run, lambda w: w - target, 400)
    ws = torch.stack([w for _, w in xs])
    cert = [float((ws[k * 10:(k + 1) * 10] - target).mean(0).norm()) for k in range(40)]
    assert F(xs[-1][0]) < 0.05 * F(xs[0][0])
    assert cert[-1] < 0.1 * cert[0] and cert[-1] < 0.05
