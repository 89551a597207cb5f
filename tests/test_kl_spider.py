"""KL-Spider (Alg. 1) end to end: SPIDER's exact telescoping, step lengths, round logic, the
precommitted plan, the cost table, refusals and exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import make_run
from dpregistry import UpdateRule, UserError, hookimpl
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.privacy.events import PrivacyEvent

from dpreg_kl.report import cost_table
from dpreg_kl.updates import StepBound


def spider_recipe(**over):
    """The κ = 4/3 quartic at n√ρ = 1e6: the smallest size whose floor is below F0, so that rounds
    run T_k = 2 steps and issue difference queries."""
    r = {"algorithm": {"name": "kl_spider"},
         "objective": {"name": "kl_power", "dim": 5, "n": 1_000_000, "power": 4},
         "privacy": {"rho": 1.0, "noise": "reproducible"},
         "train": {"steps": 10**6, "log_every": 10**6}}
    for k, v in over.items():
        r[k] = {**r[k], **v} if isinstance(v, dict) and isinstance(r.get(k), dict) else v
    return r


def trace(run, limit=None):
    """Train, recording after every step the params, v and the controller state."""
    rows = []

    def cb(r, metrics):
        a, v = r.algorithm.state, r.privatizer.state.v
        rows.append({"w": r.params["w"].clone(), "v": v["w"].clone() if v else None,
                     "k": a.k, "t": a.t, "fresh": a.fresh, "m": dict(metrics)})
        if limit and len(rows) >= limit:
            r.stop_reason = "test limit"

    summary = run.train(progress=cb)
    return rows, summary


def check_trajectory(run, rows, w0):
    """C1: v − ∇F(w) equals the sum of the noise since the round's anchor (replayed from the run's
    noise stream, independently of the privatizer), to 1e-10. C2: every step has length r_k.
    C3/B6: a round moves only while ‖v‖ ≥ θ_k and at most T_k times, issuing ≤ T_k − 1 differences;
    a round that stops at its anchor hands the same w to the next round. Returns per-round counts."""
    s, obj, d = run.algorithm.sched, run.objective, run.params["w"].numel()
    w_query, noise_sum, rounds = w0.clone(), None, {}
    for step, row in enumerate(rows):
        m = row["m"]
        k = int(m["round"]) - 1
        info = rounds.setdefault(k, {"releases": 0, "moves": 0})
        anchor = info["releases"] == 0
        info["releases"] += 1
        b = m["noise_std"] * run.rng.noise(step, 0).randn((d,), dtype=torch.float64)
        noise_sum = b if anchor else noise_sum + b
        v, grad = row["v"], obj.full_grad(w_query)
        err = float((v - grad - noise_sum).norm())
        assert err <= 1e-10 * float(max(v.norm(), grad.norm())), (step, err)
        # Lemma 2's certificate (C5, w.p. ≥ 1 − β; exact mode's C_f keeps it): ‖v − ∇F‖ ≤ Φ̂_k^{1/κ}/(8γ)
        assert float(noise_sum.norm()) <= s.phi[k] ** (1 / s.kappa) / (8 * s.gamma), step
        assert m["v_norm"] == pytest.approx(float(v.norm()), rel=1e-12)
        moved = float((row["w"] - w_query).norm())
        if m["moved"]:
            info["moves"] += 1
            assert m["v_norm"] >= s.theta[k] and info["moves"] <= s.T[k]
            # exact up to the rounding of w to float64 (‖w‖·2⁻⁵³ against r_k), never longer than r_k
            assert moved == pytest.approx(s.r[k], rel=1e-10) and moved <= s.r[k] * (1 + 1e-15)
        else:
            assert moved == 0.0 and m["v_norm"] < s.theta[k]
        assert info["releases"] - 1 <= s.T[k] - 1
        w_query = row["w"].clone()
    assert m["clip_activations"] == 0  # the declared L0 and L1 hold along the trajectory
    return rounds


def test_spider_telescoping_and_step_length(tmp_path):
    run = make_run(spider_recipe(train={"steps": 400}), tmp_path)
    s = run.algorithm.sched
    assert s.kappa == pytest.approx(4 / 3) and s.T[0] == 2
    w0 = run.params["w"].clone()
    rows, summary = trace(run)
    assert summary["step"] == len(rows) == 400
    rounds = check_trajectory(run, rows, w0)
    assert sum(1 for r in rounds.values() if r["releases"] == 2) > 10  # rounds with a difference query


def test_spider_rounds_end_early_and_restart(tmp_path):
    run = make_run(spider_recipe(objective={"power": 2, "n": 100_000}), tmp_path)
    s = run.algorithm.sched
    assert s.kappa == 2 and s.worst_case_releases == s.K
    w0 = run.params["w"].clone()
    rows, summary = trace(run)
    assert summary["step"] == s.K
    rounds = check_trajectory(run, rows, w0)
    assert len(rounds) == s.K and sum(1 for r in rounds.values() if r["moves"] == 0) > 10
    assert run.objective.excess_risk() < 2 * s.phi_floor


def test_spider_plan_ledger_and_cost_table(tmp_path):
    run = make_run(spider_recipe(), tmp_path)
    plan = run.algorithm.plan(run.ctx, None)
    planned = {c.event: c.count for c in plan}
    rho_plan = run.accountant.rho_of({None: planned})
    assert rho_plan <= 1.0 * (1 + 1e-12)
    run.train()
    entries = run.accountant.ledger.to_json()
    used: dict = {}
    for e in entries:
        ev = PrivacyEvent.from_dict(e["event"])
        used[ev] = used.get(ev, 0) + e["count"]
    for ev, k in used.items():  # every charge was planned, and no more often than planned
        assert ev in planned and k <= planned[ev]
    table = cost_table(entries)
    total = sum(r["rho"] for r in table)
    assert total == pytest.approx(run.accountant.rho(), rel=1e-12) and total <= 1.0 * (1 + 1e-12)
    assert sum(r["count"] for r in table) == run.step
    s = run.algorithm.sched
    differences = [ev for ev in used if ev != run.algorithm.anchor_event()]
    assert len(differences) > 10  # one event per (σ_k, r_k) until the floor
    assert sum(used[ev] for ev in differences) > 20  # difference queries were charged
    assert run.objective.excess_risk() < s.phi_floor  # Theorem 1's certificate (w.p. ≥ 1 − β)


def test_spider_paper_calibration_is_refused_under_replace_one(tmp_path):
    with pytest.raises(UserError, match=r"true replace-one cost is 2(\.\d+)?ρ"):
        make_run(spider_recipe(algorithm={"name": "kl_spider", "calibration": "paper"}), tmp_path)
    # under add/remove the paper's σ's cost about a quarter as much and fit
    run = make_run(spider_recipe(algorithm={"name": "kl_spider", "calibration": "paper"},
                                 privacy={"rho": 1.0, "relation": "add_remove"}), tmp_path)
    a, d = run.algorithm.sched.planned_costs()
    assert 0.5 <= a + d <= 0.54


@pytest.mark.parametrize("bad, match", [
    ({"update": {"name": "sgd", "lr": 0.1}}, "'spider_fullbatch' needs StepBound"),  # sgd bounds no step
    ({"sampler": {"name": "poisson", "batch_size": 100}}, "full batch"),
    ({"algorithm": {"name": "kl_spider", "kappa": 3}}, r"κ in \[1, 2\]"),
    ({"privatizer": {"name": "scheduled_gaussian"}}, "spider_gaussian|cannot release"),
])
def test_spider_refusals(tmp_path, bad, match):
    with pytest.raises(UserError, match=match):
        make_run(spider_recipe(**bad), tmp_path)


class MeasuredSGD(UpdateRule):
    """Gradient steps that report their measured length as the step bound: enough for the SPIDER
    estimator (a public bound on each step), not for kl_spider's precommitted plan."""

    name = "measured_sgd_test"
    provides = (StepBound,)

    def setup(self, ctx):
        self.last: float | None = None

    def provide(self, kind):
        return StepBound(self.last)

    @torch.no_grad()
    def apply(self, params, release, ctx):
        g = release.value.lift(params)
        self.last = float(sum((0.1 * g[k]).double().pow(2).sum() for k in params) ** 0.5)
        for k, x in params.items():
            x.sub_(0.1 * g[k])


class _MeasuredSGDPlugin:
    @hookimpl
    def dpreg_register_update_rules(self, register):
        register(MeasuredSGD)


def test_spider_refuses_steps_that_are_not_normalised(tmp_path):
    """A rule that provides a StepBound satisfies the estimator, but the plan charges each difference
    query at 2L1·r_k/n before step 1, which only steps of length r_k keep (spec §4, coupling 3)."""
    from dpregistry.registry import Registry

    registry = Registry().load_entry_points()
    registry.add_plugin(_MeasuredSGDPlugin(), origin="tests (measured sgd)")
    with pytest.raises(UserError, match="normalised steps") as e:
        make_run(spider_recipe(update={"name": "measured_sgd_test"}), tmp_path, registry=registry)
    assert e.value.key == "update" and e.value.line is not None  # located at the recipe's update line


def test_spider_k_nonpositive_returns_w0(tmp_path):
    run = make_run(spider_recipe(objective={"n": 5}, privacy={"rho": 1e-6}), tmp_path)
    assert run.algorithm.sched.K == 0 and run.total_steps == 0
    summary = run.train()
    assert summary["step"] == 0 and float(run.params["w"].abs().max()) == 0.0
    assert run.accountant.ledger.n_charges == 0


def test_spider_resume_mid_round_is_exact(tmp_path):
    recipe = spider_recipe(train={"steps": 60, "checkpoint_every": 7, "keep_checkpoints": 100, "log_every": 5})
    out = tmp_path / "a"
    out.mkdir()
    run = make_run(recipe, tmp_path, out=out)
    run.train()
    final_w, final_ledger = run.params["w"].clone(), run.accountant.ledger.to_json()
    # a checkpoint taken in the middle of a round (its next release is a difference query)
    chosen = next(step for step, path in ckpt.list_checkpoints(out / "checkpoints")
                  if 0 < step < run.step and not ckpt.read(path)[1]["state"]["algorithm"]["fresh"])
    copy = tmp_path / "b"
    shutil.copytree(out, copy)
    for step, p in ckpt.list_checkpoints(copy / "checkpoints"):
        if step > chosen:
            p.unlink()
    resumed = resume_run(copy)
    assert resumed.step == chosen and not resumed.algorithm.state.fresh
    resumed.train()
    assert torch.equal(resumed.params["w"], final_w)
    assert json.dumps(resumed.accountant.ledger.to_json(), sort_keys=True) == json.dumps(final_ledger, sort_keys=True)


def test_the_difference_query_is_clipped_to_the_update_rules_step_bound(tmp_path):
    """The typed exchange behind the difference query's sensitivity: normalized_step provides the
    length of its last step as a StepBound (through the run), spider_fullbatch tags each difference
    with it, and spider_gaussian clips to L1·bound and charges Δ = 2·L1·bound (replace-one) for it.
    A move longer than the declared bound is refused, not released with a sensitivity it lacks."""
    from dpregistry import Release
    from dpregistry.privacy.events import clipped_sum_sensitivity
    from dpregistry.spaces import DenseAggregate

    run = make_run(spider_recipe(), tmp_path)
    obj, upd, est, priv, params = run.objective, run.update_rule, run.estimator, run.privatizer, run.params
    idx = run.sampler.indices(run.ctx)
    L1 = obj.kl_constants().smoothness
    assert priv.smoothness == L1 == 3.0
    assert run.ctx.need(StepBound) == StepBound(None)  # no step yet
    anchor = next(est.contributions(obj, idx, run.ctx))
    assert anchor.kind == "gradient"
    priv.release(priv.clip_sum(anchor), run.ctx, std=1.0)
    r, w0 = 0.05, params["w"].clone()
    upd.set_length(r)
    upd.apply(params, Release(DenseAggregate({"w": torch.arange(1.0, 6.0, dtype=torch.float64)}), []), run.ctx)
    assert run.ctx.need(StepBound) == StepBound(r) and float((params["w"] - w0).norm()) <= r
    diff = next(est.contributions(obj, idx, run.ctx))
    assert diff.kind == "increment" and diff.info["step_bound"] == r
    release = priv.release(priv.clip_sum(diff), run.ctx, std=1.0)
    assert release.events[0].sensitivity == clipped_sum_sensitivity(L1 * r, "replace_one") == 2 * L1 * r
    with torch.no_grad():
        params["w"][0] += 2 * r  # twice the declared bound
    with pytest.raises(RuntimeError, match="more than the update rule's step bound"):
        next(est.contributions(obj, idx, run.ctx))
