"""Adaptive noisy GD (Alg. 3) with the zCDP privacy filter, the 3-SP selection, and the ZO mix."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import RECIPES, make_run
from dpregistry import BudgetExhausted, Charge, UserError
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.privacy.events import Exponential, Gaussian, PrivacyEvent
from dpregistry.registry import get_registry

from dpreg_kl.report import cost_table


def agd_recipe(**over):
    r = {"algorithm": {"name": "adaptive_noisy_gd"},
         "objective": {"name": "kl_power", "dim": 3, "n": 3000, "power": 4},
         "update": {"name": "sgd", "lr": 1 / 6},   # η = 1/(2L1), L1 = 3 on the unit ball
         "privacy": {"rho": 1.0, "noise": "reproducible"},
         "train": {"steps": 10**6, "log_every": 10**6}}
    for k, v in over.items():
        r[k] = {**r[k], **v} if isinstance(v, dict) and isinstance(r.get(k), dict) else v
    return r


def traced(run):
    rows = []
    summary = run.train(progress=lambda r, m: rows.append(dict(m)))
    return rows, summary


def ledger_events(run) -> list[PrivacyEvent]:
    out = []
    for e in run.accountant.ledger.to_json():
        out += [PrivacyEvent.from_dict(e["event"])] * e["count"]
    return out


def test_adaptive_charges_the_sigma_it_uses(tmp_path):
    """B3/B4: σ_t = max{N_t/√(dℓ), σ_min} from the released N_t; each step charges a norm query
    at σ̂ and a gradient query at σ_t with Δ = 2L0/n; the filter stops the run within ρ, with
    T ≤ n√ρ/2."""
    run = make_run(agd_recipe(), tmp_path)
    c, n = run.algorithm.consts, run.n_train
    rows, summary = traced(run)
    T = summary["step"]
    assert 5 < T <= n * math.sqrt(1.0) / 2
    assert summary["stopped"] is None or "afford" in summary["stopped"]  # done after a clamped step, or refused
    events = ledger_events(run)
    sens = 2 * run.privatizer.clip  # replace-one, on the clipped sum
    for t, m in enumerate(rows):
        if m["clamped"]:  # the last step: σ' spends exactly the rest of ρ, at most 2σ_t
            assert t == T - 1 and c.sigma_t(m["noisy_norm"], 3) < m["sigma"] <= 2 * c.sigma_t(m["noisy_norm"], 3)
            assert run.accountant.rho() == pytest.approx(1.0, rel=1e-8)
        else:
            assert m["sigma"] == c.sigma_t(m["noisy_norm"], 3)
        assert events[2 * t] == Gaussian(std=c.sigma_norm * n, sensitivity=sens)
        assert events[2 * t + 1] == Gaussian(std=m["sigma"] * n, sensitivity=sens)
    assert len(events) in (2 * T, 2 * T + 1)  # + a refused step's norm query, if that one fit
    total = sum(r["rho"] for r in cost_table(run.accountant.ledger.to_json()))
    assert total == pytest.approx(run.accountant.rho(), rel=1e-12) and total <= 1.0 * (1 + 1e-12)
    assert run.objective.excess_risk() < 0.2 * run.objective.kl_constants().f0


def first_step_below_zero(tmp_path, **over):
    """A run started at w* (∇F = 0), so N_t is pure noise; the first seed where N_t ≤ 0 occurs."""
    for seed in range(40):
        run = make_run(agd_recipe(seed=seed, **over), tmp_path)
        run.params["w"].copy_(run.objective.w_star)
        rows, summary = traced(run)
        hits = [t for t, m in enumerate(rows) if m["noisy_norm"] <= 0]
        if hits:
            return run, rows, summary, hits
    raise AssertionError("no non-positive N_t in 40 seeds")


def test_nonpositive_noisy_norm_is_charged_at_the_floor(tmp_path):
    """B5, corrected point 2: N_t ≤ 0 gives σ_t = σ_min, charged at its true cost ρ/2 (+ the norm
    query), where the paper's closed form min{L0²dℓ/(n²N_t²), ρ/2} + √ρ/n is far smaller."""
    run, rows, summary, hits = first_step_below_zero(tmp_path)
    c, n = run.algorithm.consts, run.n_train
    events = ledger_events(run)
    for t in hits:
        m = rows[t]
        assert m["sigma"] == c.sigma_min
        assert events[2 * t + 1] == Gaussian(std=c.sigma_min * n, sensitivity=2 * run.privatizer.clip)
        true = m["step_cost"]
        assert true == pytest.approx(0.5 + 2 / n, rel=1e-12)
        assert c.paper_ledger_entry(m["noisy_norm"], 3) < true / 5
    assert run.accountant.rho() <= 1.0 * (1 + 1e-12)


def test_stop_on_floor(tmp_path):
    run, rows, summary, hits = first_step_below_zero(tmp_path, algorithm={"name": "adaptive_noisy_gd",
                                                                          "stop_on_floor": True})
    first_floor = next(t for t, m in enumerate(rows) if m["at_floor"])
    assert summary["step"] == first_floor + 1 and summary["stopped"] is None  # Lemma 11, exact


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(costs=st.lists(st.one_of(st.floats(1e-6, 5.0), st.just(0.0), st.just(math.inf), st.floats(1e-12, 1e-9)),
                      min_size=1, max_size=60),
       budget=st.floats(0.01, 10.0))
def test_zcdp_filter_never_exceeds_rho(costs, budget):
    """A4: whatever costs arrive (0, tiny, huge, inf), the zCDP filter's ledger never passes ρ, and a
    refused charge leaves the ledger unchanged."""
    reg = get_registry()
    acc = reg.get("accountant", "zcdp").cls()
    from dpregistry import Budget
    acc.bind(Budget(rho=budget))
    for step, cost in enumerate(costs):
        ev = Gaussian(std=0.0 if cost == math.inf else (1.0 / math.sqrt(2 * cost) if cost else 1e100), sensitivity=1.0)
        before = acc.rho()
        try:
            acc.charge([Charge(ev)], step)
        except BudgetExhausted:
            assert acc.rho() == before
        assert acc.rho() <= budget * (1 + 1e-12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), n_per=st.integers(100, 1500), log_rho=st.floats(-2.0, 1.0),
       power=st.sampled_from([2.0, 4.0]), select=st.sampled_from(["last", "exponential"]),
       floor=st.booleans(), clamp=st.booleans(), relation=st.sampled_from(["replace_one", "add_remove"]))
def test_adaptive_runs_never_exceed_rho(tmp_path, seed, n_per, log_rho, power, select, floor, clamp, relation):
    rho = 10 ** log_rho
    run = make_run(agd_recipe(seed=seed, objective={"n": 3 * n_per, "power": power},
                              update={"name": "sgd", "lr": 0.5 if power == 2 else 1 / 6},
                              algorithm={"name": "adaptive_noisy_gd", "select": select, "stop_on_floor": floor,
                                         "clamp_last": clamp},
                              privacy={"rho": rho, "relation": relation}), tmp_path)
    summary = run.train()
    n = 3 * n_per
    assert run.accountant.rho() <= rho * (1 + 1e-12)
    rho_gd = rho * (1 - run.algorithm.cfg.selection_share) if select == "exponential" else rho
    descent = summary["step"] - (1 if select == "exponential" else 0)
    assert descent <= n * math.sqrt(rho_gd) / 2 + 1e-9
    selections = [e for e in ledger_events(run) if isinstance(e, Exponential)]
    if select == "exponential":
        assert len(selections) == 1 and selections[0].zcdp_rho() == pytest.approx(rho / 3, rel=1e-12)
        assert run.accountant.rho() - rho / 3 <= rho_gd * (1 + 1e-12)
    else:
        assert not selections


def test_exponential_selection_and_resume(tmp_path):
    """3-SP: the output is one of the released iterates, chosen by the exponential mechanism and
    charged once (ε²/8 = ρ/3); a resume from a mid-run checkpoint ends bit-identical."""
    recipe = agd_recipe(algorithm={"name": "adaptive_noisy_gd", "select": "exponential"},
                        train={"steps": 10**6, "checkpoint_every": 5, "keep_checkpoints": 1000, "log_every": 5})
    out = tmp_path / "a"
    out.mkdir()
    run = make_run(recipe, tmp_path, out=out)
    rows, summary = traced(run)
    assert summary["stopped"] is None and run.algorithm.state.phase == "done"
    chosen = int(rows[-1]["selected_iterate"])
    assert rows[-1]["candidates"] == len(run.algorithm.state.trajectory) == summary["step"]  # w_0 .. w_T
    assert torch.equal(run.params["w"], run.algorithm.state.trajectory[chosen]["w"])
    sel = [e for e in ledger_events(run) if isinstance(e, Exponential)]
    assert len(sel) == 1 and sel[0].zcdp_rho() == pytest.approx(1 / 3, rel=1e-12)
    assert run.accountant.rho() <= 1.0 * (1 + 1e-12)
    final = run.params["w"].clone()
    mid = [s for s, _ in ckpt.list_checkpoints(out / "checkpoints") if 0 < s < summary["step"] - 1][-1]
    copy = tmp_path / "b"
    shutil.copytree(out, copy)
    for s, p in ckpt.list_checkpoints(copy / "checkpoints"):
        if s > mid:
            p.unlink()
    resumed = resume_run(copy)
    assert resumed.step == mid and len(resumed.algorithm.state.trajectory) == mid + 1
    resumed.train()
    assert torch.equal(resumed.params["w"], final)
    assert resumed.accountant.rho() == run.accountant.rho()


@pytest.mark.parametrize("bad, match", [
    ({"accountant": {"name": "pld"}}, "privacy filter"),
    ({"estimator": {"name": "zo_two_point"}, "update": {"name": "directional_sgd", "lr": 0.01},
      "algorithm": {"name": "adaptive_noisy_gd", "select": "exponential"}}, "no stationarity meaning"),
    ({"sampler": {"name": "poisson", "batch_size": 100}}, "full batch"),
    ({"privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0}}, "scheduled_gaussian"),
])
def test_adaptive_refusals(tmp_path, bad, match):
    with pytest.raises(UserError, match=match):
        make_run(agd_recipe(**bad), tmp_path)


def test_mixed_zeroth_order_recipe(tmp_path):
    """The mix (adaptive noise + filter over the ZO estimator): every step's σ_t uses d = 1, the
    number of noised coordinates, and the run stays within ρ while it descends."""
    run = make_run(RECIPES / "kl_adaptive_gd_zo.yaml", sets=["privacy.noise=reproducible"])
    f_start = run.objective.excess_risk()
    rows, summary = traced(run)
    c = run.algorithm.consts
    assert summary["step"] >= 4  # the filter admits 5-12 steps over noise draws (6 for this recipe's seed)
    for m in rows:
        if not m["clamped"]:
            assert m["sigma"] == c.sigma_t(m["noisy_norm"], 1)
    assert run.accountant.rho() <= 1.0 * (1 + 1e-12)
    assert float(run.params["w"].abs().max()) > 0 and run.objective.excess_risk() < f_start


@pytest.mark.parametrize("steps", [1, 5])
def test_exponential_selection_also_ends_a_run_capped_by_train_steps(tmp_path, steps):
    """3-SP's output is the exponential mechanism's pick whatever ends the descent: when train.steps
    runs out before the filter does, the last step allowed is the selection (charged once), not a
    descent step that leaves the last iterate as the output."""
    run = make_run(agd_recipe(algorithm={"name": "adaptive_noisy_gd", "select": "exponential"},
                              train={"steps": steps, "log_every": 10**6}), tmp_path)
    assert run.algorithm.consts.max_steps + 1 > steps  # train.steps, not the filter, ends this run
    rows, summary = traced(run)
    assert summary["step"] == steps and run.algorithm.state.phase == "done"
    assert rows[-1]["candidates"] == len(run.algorithm.state.trajectory) == steps  # w_0 .. w_(steps−1)
    chosen = int(rows[-1]["selected_iterate"])
    assert torch.equal(run.params["w"], run.algorithm.state.trajectory[chosen]["w"])
    sel = [e for e in ledger_events(run) if isinstance(e, Exponential)]
    assert len(sel) == 1 and sel[0].zcdp_rho() == pytest.approx(1 / 3, rel=1e-12)
    assert run.accountant.rho() <= 1.0 * (1 + 1e-12)


def test_auto_constants_need_an_objective_that_declares_them(tmp_path):
    """`auto` reads the objective's declared KLConstants. An objective that declares none (the
    baseline quadratic) is refused at the key that says auto; with a number the same objective runs,
    its per-example gradients from torch.func, within ρ."""
    recipe = agd_recipe(train={"steps": 5, "log_every": 10**6})
    recipe["objective"] = {"name": "quadratic", "dim": 3, "n": 300, "n_test": 10}
    with pytest.raises(UserError, match="auto needs an objective that declares its lipschitz") as e:
        make_run(recipe, tmp_path)
    assert e.value.key == "privatizer.clip"
    recipe["privatizer"] = {"name": "scheduled_gaussian", "clip": 1.0}
    run = make_run(recipe, tmp_path)
    summary = run.train()
    assert summary["step"] == 5 and 0 < run.accountant.rho() <= 1.0


def test_clamp_last_spends_what_the_zcdp_filter_has_left(tmp_path):
    """clamp_last asks the zcdp accountant (a RhoBudgeted filter) for the ρ left: the last step's σ'
    spends it to 1e-8 instead of stopping with budget left; without clamp_last the filter's refusal
    ends the run with that budget unspent (this recipe's noise, reproducible, does both)."""
    from dpreg_kl.algorithms import RhoBudgeted

    run = make_run(agd_recipe(), tmp_path)
    assert isinstance(run.accountant, RhoBudgeted)
    rows, summary = traced(run)
    assert rows[-1]["clamped"] and not any(m["clamped"] for m in rows[:-1]) and summary["stopped"] is None
    assert run.accountant.rho() == pytest.approx(1.0, rel=1e-8) and run.accountant.rho() <= 1.0
    plain = make_run(agd_recipe(algorithm={"name": "adaptive_noisy_gd", "clamp_last": False}), tmp_path)
    rows, summary = traced(plain)
    assert not any(m["clamped"] for m in rows) and "afford" in summary["stopped"]
    assert plain.accountant.rho() < 1.0 - 1e-6


def test_with_secret_noise_each_row_of_released_values_follows_its_checkpoint(tmp_path):
    """The rows hold functions of the step's releases (the noisy norm, the σ chosen from it): a
    secure run killed between checkpoints redrew those steps on resume, so the rows already shown
    were releases no ledger kept (a review). Each logged row now follows a checkpoint of its step."""
    import json

    from dpregistry.ledger_file import LedgerFile

    recipe = agd_recipe(privacy={"noise": "secure"}, train={"steps": 12, "log_every": 3, "checkpoint_every": 1000})
    run = make_run(recipe, tmp_path, out=tmp_path / "out")
    run.train()
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "noisy_norm" in r]
    assert logged and set(logged) <= {r["step"] for r in LedgerFile(tmp_path / "out").lines()}
    assert {step for step, _ in ckpt.list_checkpoints(tmp_path / "out" / "checkpoints")} >= set(logged[-2:])
