"""Data use, calibration and accounting of the nonsmooth algorithms (parallel composition, δ_fail)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from dpregistry import UserError
from dpregistry.privacy.conversions import zcdp_to_epsilon
from dpregistry.spaces import DenseAggregate
from dpregistry.stages import ClippedSum

from conftest import make_run, write_recipe
from dpreg_ztc import theory as ztc
from dpreg_nonsmooth.tree import node_set, nodes_per_record
from nonsmooth_helpers import recipe


def _collect(run):
    """Run to the end; return every step's (indices, position p, fresh flag)."""
    seen = []
    idx_fn, clip_fn = run.sampler.indices, run.privatizer.clip_sum

    def indices(ctx):
        out = idx_fn(ctx)
        seen.append([out.tolist(), run.algorithm.position(ctx.step)[1], None])
        return out

    def clip_sum(c):
        seen[-1][2] = c.info["fresh"]
        return clip_fn(c)

    run.sampler.indices, run.privatizer.clip_sum = indices, clip_sum
    run.train()
    return seen


def test_single_pass_uses_every_record_at_most_once(tmp_path):
    """Spec 001 §5.15 / spec 002 §7.12: no record twice; consumed = K(B1 + B2(T − 1)) (ZTC, whole
    episodes) or B1⌈T/Σ⌉ + B2(T − ⌈T/Σ⌉) (KLT); GRAD only at p = 1, increments only after."""
    run = make_run(recipe({"name": "ztc_o2nc_tree", "episode_len": 4}, {"name": "l1_distance", "dim": 2, "n": 203},
                          privatizer={"noise_multiplier": 0.0}), tmp_path)
    seen = _collect(run)
    used = [i for ids, _, _ in seen for i in ids]
    assert len(used) == len(set(used)) == 25 * (5 + 1 * 3)  # K = ⌊203/8⌋ = 25 episodes, 3 records dropped
    assert run.step == 100 and all((p == 1) == fresh for _, p, fresh in seen)
    assert all(len(ids) == (5 if p == 1 else 1) for ids, p, _ in seen)
    with pytest.raises(RuntimeError, match="reuse"):
        run.sampler.indices(run.context(3))

    klt = make_run(recipe({"name": "klt_sp_zo", "vr_period": 5}, {"name": "l1_distance", "dim": 2, "n": 300},
                          estimator={"dirs_per_sample": 2, "delta_fail": 0.0}, privatizer={"noise_multiplier": 0.0},
                          sampler={"batch_first": 6, "batch_rest": 2}, train={"steps": 37}), tmp_path)
    seen = _collect(klt)
    used = [i for ids, _, _ in seen for i in ids]
    starts = math.ceil(37 / 5)
    assert len(used) == len(set(used)) == 6 * starts + 2 * (37 - starts)
    # the cap: a single pass ends when the data is used up
    capped = make_run(recipe({"name": "klt_sp_zo", "vr_period": 5}, {"name": "l1_distance", "dim": 2, "n": 300},
                             estimator={"dirs_per_sample": 2, "delta_fail": 0.0}, privatizer={"noise_multiplier": 0.0},
                             sampler={"batch_first": 6, "batch_rest": 2}), tmp_path)
    T = capped.algorithm.settings.total_steps
    need = lambda t: 6 * math.ceil(t / 5) + 2 * (t - math.ceil(t / 5))
    assert need(T) <= 300 < need(T + 1)


def test_ztc_calibration_and_parallel_composition(tmp_path):
    """σ = s·sqrt(⌊log2 T⌋+1)/ρ with s = max(2dL/B1, 4dLD/(B2δ)) (spec 001 §2.8); one tree charge per
    episode in its own partition, so the run is ρ²/2-zCDP, not K-fold (§5.16); ε = ρ²/2 + ρ·sqrt(2 ln 1/δ)."""
    rho_paper, T, d, delta = 1.0, 8, 3, 0.1
    run = make_run(recipe({"name": "ztc_o2nc_tree", "episode_len": T}, {"name": "l1_distance", "dim": d, "n": 480},
                          estimator={"smooth_radius": delta}, privacy={"rho": rho_paper ** 2 / 2, "delta": 1e-5}),
                   tmp_path)
    s = run.algorithm.settings
    sigma = run.privatizer.noise_multiplier * run.privatizer.element_sensitivity()
    want = ztc.calibrate(rho_paper, T, d, 1.0, delta, s.radius, s.batch_first, s.batch_rest)
    assert want == pytest.approx(4 * d * 1.0 / T * math.sqrt(4) / rho_paper)  # B1 = T+1, D = δ/T
    assert sigma == pytest.approx(want, rel=2e-4) and sigma >= want * (1 - 1e-12)
    run.train()
    entries = run.accountant.ledger.entries
    K = 480 // (2 * T)
    assert len(entries) == K and {e["partition"] for e in entries} == {f"period{k}" for k in range(K)}
    assert all(e["event"]["type"] == "tree_aggregation" and e["event"]["nodes_per_record"] == nodes_per_record(T)
               and e["first_step"] % T == 0 for e in entries)
    rho = run.accountant.rho()
    assert rho == pytest.approx(rho_paper ** 2 / 2, rel=1e-3) and rho <= rho_paper ** 2 / 2
    eps = run.accountant.epsilon()
    assert eps == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))
    assert eps == pytest.approx(rho_paper ** 2 / 2 + rho_paper * math.sqrt(2 * math.log(1e5)), rel=1e-3)


def test_klt_paper_mode_adds_the_failure_probability_to_delta(tmp_path):
    """Spec 002 §2.5 / §7.13: KLT's high-probability sensitivity is charged with its δ_fail = 2γ (the
    differing record of both neighbouring data sets must concentrate); the reported ε holds at
    δ − Σδ_fail; an accountant that cannot add δ_fail refuses the run."""
    base = recipe({"name": "klt_sp_zo", "vr_period": 4}, {"name": "l1_distance", "dim": 2, "n": 3000},
                  estimator={"dirs_per_sample": 3000, "delta_fail": 1e-6, "smooth_radius": 0.2},
                  privacy={"epsilon": 2.0, "delta": 1e-5}, train={"steps": 12, "log_every": 100})
    run = make_run(base, tmp_path)
    R, gamma = run.estimator.public_bound(True, 0.0)
    assert gamma == 1e-6 and R < 2.0  # the concentration bound is in use (below dL = 2)
    run.train()
    entries = run.accountant.ledger.entries
    types = [e["event"]["type"] for e in entries]
    assert types.count("concentration_failure") == 3 and types.count("tree_aggregation") == 3
    assert all(e["event"]["delta"] == 2e-6 for e in entries if e["event"]["type"] == "concentration_failure")
    rho = run.accountant.rho()
    assert run.accountant.epsilon() == pytest.approx(zcdp_to_epsilon(rho, 1e-5 - 2e-6))
    assert run.accountant.epsilon() <= 2.0
    assert run.accountant.delta(2.0) >= 2e-6
    with pytest.raises(UserError, match="concentration_failure"):
        make_run({**base, "accountant": "zcdp"}, tmp_path)
    clip = make_run({**base, "estimator": {**base["estimator"], "privacy_mode": "clip"}, "accountant": "zcdp"},
                    tmp_path)  # safety_clip: deterministic sensitivity, plain zCDP accounting
    assert clip.estimator.public_bound(True, 0.0) == (pytest.approx(R), 0.0)


@pytest.mark.parametrize("bad, match", [
    ({"privatizer": {"name": "gaussian", "clip": 1.0}}, "increment"),
    ({"sampler": "full_batch"}, "single-pass"),
    ({"update": {"window": 20, "radius": 0.1}}, "Goldstein radius"),
    ({"objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [4], "activation": "relu"},
                    "data": {"dataset": "iris"}}}, "Lipschitz"),
])
def test_invalid_combinations_are_refused(tmp_path, bad, match):
    rec = recipe({"name": "ztc_o2nc_tree", "episode_len": 4}, privacy={"rho": 0.5, "delta": 1e-6})
    rec.update(bad)
    with pytest.raises(UserError, match=match):
        make_run(rec, tmp_path)


def _noise_only(run, steps):
    """Release zero increments; return each step's released vector (per-coordinate noise samples)."""
    out = []
    for t in range(steps):
        run.step = t
        ctx = run.begin_step()
        if run.algorithm.position(t)[1] == 1:
            run.privatizer.reset()
        zero = DenseAggregate({"x": torch.zeros(run.algorithm.settings.dim, dtype=torch.float64)})
        out.append(run.privatizer.release(ClippedSum(zero, count=1), ctx).value.tensors["x"].clone())
    return out


def test_noise_only_variances_tree_and_iid_prefix(tmp_path):
    """Spec 002 §7.14: f ≡ 0: the tree gives Var(g̃_t) = σ²·popcount(p) per coordinate, Alg. 4's prefix
    σ1² + (p − 1)σ2²; both restart at p = 1. Spec 002 §7.13: σ1 ∝ sqrt(T/Σ), σ2 ∝ sqrt(T)."""
    d = 20_000
    tree = make_run(recipe({"name": "ztc_o2nc_tree", "episode_len": 6}, {"name": "l1_distance", "dim": d, "n": 40},
                           estimator={"dirs_per_sample": 1}, privatizer={"noise_multiplier": 1.0}), tmp_path)
    sigma = tree.privatizer.element_sensitivity()
    for t, v in enumerate(_noise_only(tree, 12)):
        p = t % 6 + 1
        assert float(v.var()) == pytest.approx(sigma ** 2 * len(node_set(p)), rel=0.05)
    erm = recipe({"name": "klt_mp_zo_erm", "vr_period": 4, "stat_tol": 0.05},
                 {"name": "l1_distance", "dim": d, "n": 30}, estimator={"dirs_per_sample": 1},
                 privatizer={"noise_multiplier": 1.0}, train={"steps": 8})
    mp = make_run(erm, tmp_path)
    s1, s2 = mp.privatizer.stds(1.0)
    assert s1 > 0 and s2 > 0
    for t, v in enumerate(_noise_only(mp, 8)):
        p = t % 4 + 1
        assert float(v.var()) == pytest.approx(s1 ** 2 + (p - 1) * s2 ** 2, rel=0.05)
    erm["train"]["steps"] = 16
    mp2 = make_run(erm, tmp_path)
    t1, t2 = mp2.privatizer.stds(1.0)
    assert (t1 / s1, t2 / s2) == (pytest.approx(math.sqrt(2)), pytest.approx(math.sqrt(2)))


def test_privacy_report_shows_the_tree_charges(tmp_path):
    """`dpreg privacy report` lists one tree charge per episode partition, and δ_fail where charged."""
    from dpregistry.cli import app

    path = write_recipe(tmp_path, recipe({"name": "klt_sp_zo", "vr_period": 4},
                                         {"name": "l1_distance", "dim": 2, "n": 3000},
                                         estimator={"dirs_per_sample": 3000, "delta_fail": 1e-6},
                                         privacy={"epsilon": 2.0, "delta": 1e-5},
                                         train={"steps": 8, "log_every": 4}))
    out = tmp_path / "run"
    cli = CliRunner()
    res = cli.invoke(app, ["run", str(path), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    rep = cli.invoke(app, ["privacy", "report", str(out), "--json"])
    assert rep.exit_code == 0, rep.output
    data = json.loads(rep.output)
    kinds = [(e["event"]["type"], e["partition"]) for e in data["ledger"]]
    assert kinds == [("tree_aggregation", "period0"), ("concentration_failure", "period0"),
                     ("tree_aggregation", "period1"), ("concentration_failure", "period1")]
    assert data["epsilon"] <= 2.0
    text = cli.invoke(app, ["privacy", "report", str(out), "--points", "8"], terminal_width=200)
    assert text.exit_code == 0 and "tree(" in text.output and "δ_fail" in text.output
    # one row per kind of charge over the two periods, and every point of the JSON report
    assert text.output.count("period0 … period1 (2)") == 2
    points = json.loads(cli.invoke(app, ["privacy", "report", str(out), "--json", "--points", "8"]).output)
    assert [int(line.split("│")[1]) for line in text.output.splitlines()
            if line.startswith("│") and line.split("│")[1].strip().isdigit()] == [
                k for k, _ in points["spent_over_steps"]]
    # a fresh process: the plugin's event type must be registered before the ledger is read
    proc = subprocess.run([sys.executable, "-m", "dpregistry", "privacy", "report", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ledger"][1]["event"]["type"] == "concentration_failure"


def test_a_run_without_budget_is_recorded_not_refused(tmp_path):
    """Core: with no privacy section (σ = 0) every charge is recorded in the ledger and the run ends."""
    from dpregistry.cli import app

    path = write_recipe(tmp_path, recipe({"name": "ztc_o2nc_tree", "episode_len": 4},
                                         {"name": "l1_distance", "dim": 2, "n": 80},
                                         privatizer={"noise_multiplier": 0.0}))
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "np"), "-q"])
    assert res.exit_code == 0, res.output
    assert "ρ = inf" in res.output
    run = make_run(path)
    run.train()
    assert run.step == 40 and len(run.accountant.ledger.entries) == 10 and run.accountant.rho() == math.inf


def test_prop25_calibration_fits_the_exact_accounting(tmp_path):
    """KLT Prop. 2.5's σ = 4s·sqrt(log2 Σ·ln(1/δ))/ε (δ net of δ_fail) is accepted only because the exact
    plan fits; at Σ = 1 it gives σ = 0 (log2 1 = 0) and the run is refused (spec 002 [AMBIG-6])."""
    rec = recipe({"name": "klt_sp_zo", "vr_period": 16}, {"name": "l1_distance", "dim": 2, "n": 3000},
                 estimator={"dirs_per_sample": 8, "delta_fail": 0.0}, privatizer={"calibration": "klt_prop25"},
                 privacy={"epsilon": 1.0, "delta": 1e-5}, train={"steps": 64})
    run = make_run(rec, tmp_path)
    assert run.privatizer.noise_multiplier == pytest.approx(27.14, abs=0.01)  # spec 002 §7.13 at s = 1
    plan = run.algorithm.plan(run.context(), run.privatizer.noise_multiplier)
    assert run.accountant.fits(plan) and run.accountant.epsilon(extra=plan) < 1.0
    rec["algorithm"]["vr_period"] = 1
    with pytest.raises(UserError, match="budget"):
        make_run(rec, tmp_path)


def test_multi_pass_first_order_preset_composes_every_step(tmp_path):
    """`klt_mp_fo_erm` (spec 002 §1.6, no theorem): full batch, i.i.d. prefix noise, one Gaussian charge
    per step over all records (sequential composition), fresh sensitivity 2L/n."""
    run = make_run(recipe({"name": "klt_mp_fo_erm", "vr_period": 4, "stat_tol": 0.05},
                          {"name": "ring", "dim": 3, "n": 50, "noise": "linear"},
                          estimator={"smooth_radius": 0.1, "lipschitz": 1.3},
                          privacy={"epsilon": 3.0, "delta": 1e-4}, train={"steps": 8}), tmp_path)
    assert run.privatizer.sensitivities()["fresh"] == pytest.approx(2 * 1.3 / 50)
    run.train()
    entries = run.accountant.ledger.entries
    assert sum(e["count"] for e in entries) == 8 and all(e["partition"] is None for e in entries)
    assert run.accountant.epsilon() <= 3.0


@pytest.mark.parametrize("algorithm", [{"name": "ztc_o2nc_tree", "episode_len": 8}, {"name": "klt_sp_zo", "vr_period": 8}])
def test_per_step_gaussian_is_noised_for_the_batch_it_releases(tmp_path, algorithm):
    """A fresh-gradient oracle (zo_sphere_grad) with the per-step Gaussian under a driver whose
    schedule has B1 > B2: each step releases a mean over its own batch, of replace-one sensitivity
    2dL/B at that B (ZTC Lemma 3.1), so the noise must cover the smallest batch, and the period's
    charge the largest sensitivity (one record, one step: parallel composition inside the period)."""
    d, L, rho = 3, 1.0, 0.5
    rec = recipe(algorithm, {"name": "l1_distance", "dim": d, "n": 2000},
                 estimator={"name": "zo_sphere_grad", "smooth_radius": 0.1, "lipschitz": L, "dirs_per_sample": 1},
                 privatizer={"name": "bounded_gaussian"}, accountant="zcdp",
                 privacy={"rho": rho, "delta": 1e-6}, train={"steps": 32, "log_every": 10**6})
    run = make_run(rec, tmp_path)
    s = run.algorithm.settings
    assert s.batch_first > s.batch_rest == 1  # the schedule this test is about
    rows = []
    run.train(progress=lambda r, m: rows.append((m["batch_size"], m["noise_std"])))
    assert {b for b, _ in rows} == {s.batch_first, s.batch_rest}
    worst = max((2 * d * L / b) ** 2 / (2 * std ** 2) for b, std in rows)  # ρ of the worst step's record
    assert worst <= rho * (1 + 1e-9)
    charged = [e["event"]["sensitivity"] for e in run.accountant.ledger.entries]
    assert charged and all(c == pytest.approx(2 * d * L / s.batch_rest) for c in charged)
    assert run.accountant.rho() <= rho * (1 + 1e-12)


def test_zcdp_fail_never_admits_a_rounding_over_a_rho_budget():
    """A pure ρ budget is decided exactly: 3 charges of ρ/3 (rounded up by one ulp) sum to a hair
    over ρ and must not fit (a relative tolerance of 1e-12 let such totals through)."""
    from dpregistry.privacy.accountant import make_accountant
    from dpregistry.privacy.events import ZCDP
    from dpregistry.stages import Charge

    rho = 0.1
    acc = make_accountant("zcdp_fail", {"rho": rho})
    third = math.nextafter(rho / 3, 1.0)
    assert 3 * Fraction(third) > Fraction(rho)
    assert not acc.fits([Charge(ZCDP(third), count=3)])
    assert acc.fits([Charge(ZCDP(rho / 3), count=3)]) == (3 * Fraction(rho / 3) <= Fraction(rho))
    assert acc.fits([Charge(ZCDP(rho))])


def test_the_ledger_reads_as_one_row_per_kind_of_charge():
    """400 episodes' tree charges on disjoint partitions are one row that says how many, where and
    how often; charges that differ stay apart."""
    from dpregistry.report import ledger_rows

    tree = [{"describe": "tree", "count": 1, "partition": f"period{i}", "first_step": 50 * i, "last_step": 50 * i}
            for i in range(400)]
    steps = {"describe": "gaussian", "count": 7, "partition": None, "first_step": 0, "last_step": 6}
    rows = ledger_rows([steps] + tree + [dict(tree[0], count=2, first_step=20000, last_step=20000)])
    assert rows == [{"steps": "0–6", "count": "7", "partition": "all", "event": "gaussian"},
                    {"steps": "0–19950, every 50", "count": "400 × 1", "partition": "period0 … period399 (400)",
                     "event": "tree"},
                    {"steps": "20000–20000", "count": "2", "partition": "period0", "event": "tree"}]


@pytest.mark.parametrize("mode", ["paper", "clip"])
def test_a_record_outside_the_declared_lipschitz_domain_moves_the_sum_by_at_most_the_sensitivity(tmp_path, mode):
    """min_of_norms declares L = 1.1 for data in the unit ball. A record at 100 broke paper mode's
    bound by 10 × in a review (paper mode trusted L); both modes now clip at the public bound (where
    L holds the clip never binds: the shipped recipes' fingerprints are unchanged)."""
    from dpregistry.api import load_recipe
    from dpregistry.run import Run

    def clipped_sum(record):
        run = Run(load_recipe("klt_sp_fo_min_of_norms", ["train.steps=200", "objective.n=2000",
                                                         f"estimator.privacy_mode={mode}"])).prepare()
        run.begin_step()
        idx = run.sampler.order[:run.privatizer.settings.batch_first]
        if record is not None:
            run.objective.z[int(idx[0])] = record
        torch.manual_seed(0)
        total = run.privatize_batch(idx)
        charged = run.privatizer.sensitivities()["fresh"] * len(idx)  # 2R/B on the mean: 2R on the sum
        return torch.cat([v.reshape(-1).double() for v in total.aggregate.tensors.values()]), charged, total

    base, charged, _ = clipped_sum(None)
    moved, _, total = clipped_sum(100.0)
    assert total.clipped == 1
    assert float((moved - base).norm()) <= charged * (1 + 1e-6)  # before: 10.2 × the charged 2R


def test_zcdp_fail_calibrates_the_noise_to_a_rho_budget_alone(tmp_path):
    """privacy.rho alone is a budget zcdp_fail holds, yet calibrating to it asked for ε and δ (a
    review): with no failure probability charged it calibrates the noise zcdp does, and the plan
    spends at most ρ; one that charges a failure probability is still refused."""
    from conftest import REPO

    path = REPO / "recipes" / "klt_oracle_ztc_tree.yaml"
    runs = {acc: make_run(path, tmp_path, sets=["objective.n=2000", f"accountant={acc}"]) for acc in ("zcdp", "zcdp_fail")}
    z = {acc: r.privatizer.noise_multiplier for acc, r in runs.items()}
    assert z["zcdp_fail"] == pytest.approx(z["zcdp"], rel=1e-3)
    fail = runs["zcdp_fail"]
    planned = max(rho for rho, _ in fail.accountant._totals(fail.accountant.ledger.grouped(fail.plan())))
    assert 0.99 * fail.budget.rho <= planned <= fail.budget.rho
    with pytest.raises(UserError, match="meets the budget"):
        make_run(path, tmp_path, sets=["objective.n=2000", "accountant=zcdp_fail", "estimator.privacy_mode=paper"])


def test_fo_ball_refuses_fewer_than_one_direction(tmp_path):
    """dirs_per_sample ≤ 0 passed validate and failed at the first variance-reduced step (a review)."""
    from conftest import REPO

    for m in (-1, 0):
        with pytest.raises(UserError, match="at least 1"):
            make_run(REPO / "recipes" / "klt_sp_fo_min_of_norms.yaml", tmp_path,
                     sets=[f"estimator.dirs_per_sample={m}", "estimator.delta_fail=0"])


def test_iid_prefix_refuses_single_pass_data(tmp_path):
    """iid_prefix charges a record at every step of its period (KLT Alg. 4 reuses the data); over
    single-pass data that was twice what the run spent, under a noise multiplier of neither release
    (a review)."""
    from conftest import REPO

    with pytest.raises(UserError, match="tree_aggregation or bounded_gaussian"):
        make_run(REPO / "recipes" / "ztc_l1.yaml", tmp_path, sets=["privatizer.name=iid_prefix", "objective.n=4000"])
    assert make_run(REPO / "recipes" / "klt_mp_zo_erm_ring.yaml", tmp_path).privatizer.name == "iid_prefix"
