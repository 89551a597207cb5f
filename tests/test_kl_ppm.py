"""Private proximal point (Alg. 2) with projected noisy GD (Alg. 4) as the inner solver."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_run
from dpregistry import UserError
from dpregistry.privacy.events import PrivacyEvent


def ppm_recipe(**over):
    r = {"algorithm": {"name": "kl_proximal_point", "weak_convexity": 0.5, "max_inner_steps": 8},
         "objective": {"name": "kl_power", "dim": 2, "n": 2000, "power": 2},
         "privacy": {"rho": 1.0, "noise": "reproducible"},
         "train": {"steps": 10**6, "log_every": 10**6}}
    for k, v in over.items():
        r[k] = {**r[k], **v} if isinstance(v, dict) and isinstance(r.get(k), dict) else v
    return r


def test_projection_weighted_average_and_budget(tmp_path):
    """C7: the inner iterates stay in B_R(c), R = L0/(2L̃1); each call returns the weighted average
    2/(T_A(T_A+1)) Σ j·u_j (recomputed here from the recorded iterates). B7: T calls at ρ/T each
    spend ρ exactly in exact mode."""
    run = make_run(ppm_recipe(), tmp_path)
    s, upd = run.algorithm.sched, run.update_rule
    assert s.capped and s.T_A == 8 and s.radius == pytest.approx(1.0)
    calls, current = [], None

    def cb(r, m):
        nonlocal current
        if current is None:
            current = {"centre": upd.state.centre["w"].clone(), "u": [upd.state.centre["w"].clone()]}
        if r.algorithm.state.started:  # inside a call: the params are u_{j}
            current["u"].append(r.params["w"].clone())
        else:  # the call just ended: the params are the average; u_{T_A} went into it
            current["out"] = r.params["w"].clone()
            calls.append(current)
            current = None

    # record u_{T_A} too: the update rule's last apply happens in the call's final step
    orig = upd.apply

    def spy(params, release, r):
        orig(params, release, r)
        if upd.j == s.T_A and current is not None:
            current["u"].append(params["w"].clone())

    upd.apply = spy
    summary = run.train(progress=cb)
    assert len(calls) == s.T and summary["step"] == s.T * (s.T_A - 1)
    for call in calls:
        us = call["u"]
        assert len(us) == s.T_A
        for u in us:
            assert float((u - call["centre"]).norm()) <= s.radius * (1 + 1e-12)
        J = len(us)
        avg = sum((j + 1) * u for j, u in enumerate(us)) * (2.0 / (J * (J + 1)))
        assert torch.allclose(call["out"], avg, rtol=1e-12, atol=1e-15)
    assert 1.0 * (1 - 2e-9) <= run.accountant.rho() <= 1.0  # spent to the sizing margin, never over
    assert run.objective.excess_risk() < 0.05 * run.objective.kl_constants().f0


def test_paper_calibration_spends_at_most_half(tmp_path):
    """Alg. 4 at the paper's σ_A² = 4L0²T_A/(n²ρ_A) costs (T_A − 1)/T_A · ρ_A/2 per call (replace-one)."""
    run = make_run(ppm_recipe(algorithm={"name": "kl_proximal_point", "weak_convexity": 0.5,
                                         "max_inner_steps": 8, "calibration": "paper"}), tmp_path)
    s = run.algorithm.sched
    plan = run.algorithm.plan(run.ctx, None)
    assert len(plan) == 1 and plan[0].count == s.T * (s.T_A - 1)
    run.train()
    assert run.accountant.rho() == pytest.approx((s.T_A - 1) / s.T_A / 2, rel=1e-9)
    events = {PrivacyEvent.from_dict(e["event"]) for e in run.accountant.ledger.to_json()}
    assert events == {plan[0].event}


def test_kappa_three_power_loss(tmp_path):
    """κ = 3 (f = |w − w*|^{3/2}/(3/2), d = 1): PPM is the algorithm for κ ≥ 2; the excess drops."""
    run = make_run(ppm_recipe(objective={"dim": 1, "n": 4000, "power": 1.5},
                              algorithm={"name": "kl_proximal_point", "weak_convexity": 1.0, "max_inner_steps": 6}),
                   tmp_path)
    assert run.algorithm.sched.kappa == pytest.approx(3.0)
    f0 = run.objective.excess_risk()
    run.train()
    assert run.objective.excess_risk() < 0.05 * f0
    assert run.accountant.rho() <= 1.0 * (1 + 1e-12)


@pytest.mark.parametrize("bad, match", [
    ({"objective": {"power": 4}}, "κ ≥ 2"),
    ({"algorithm": {"name": "kl_proximal_point", "weak_convexity": "auto"}}, "weak_convexity"),
    ({"update": {"name": "sgd", "lr": 0.1}}, "prox_projected_gd"),
])
def test_ppm_refusals(tmp_path, bad, match):
    with pytest.raises(UserError, match=match):
        make_run(ppm_recipe(**bad), tmp_path)


def test_ppm_resume_inside_a_call_is_exact(tmp_path):
    from dpregistry import checkpoint as ckpt
    from dpregistry.folder import resume_run
    import shutil

    recipe = ppm_recipe(train={"steps": 40, "checkpoint_every": 3, "keep_checkpoints": 100, "log_every": 5})
    out = tmp_path / "a"
    out.mkdir()
    run = make_run(recipe, tmp_path, out=out)
    run.train()
    final = run.params["w"].clone()
    mid = next(s for s, p in ckpt.list_checkpoints(out / "checkpoints")
               if 0 < s < 40 and ckpt.read(p)[1]["state"]["algorithm"]["started"])
    copy = tmp_path / "b"
    shutil.copytree(out, copy)
    for s, p in ckpt.list_checkpoints(copy / "checkpoints"):
        if s > mid:
            p.unlink()
    resumed = resume_run(copy)
    assert resumed.algorithm.state.started and resumed.update_rule.j > 1
    resumed.train()
    assert torch.equal(resumed.params["w"], final)
    assert math.isclose(resumed.accountant.rho(), run.accountant.rho(), rel_tol=0, abs_tol=0)
