"""Budget enforcement through the engine: a plan over budget is refused before step 1, the ledger
is charged every step and travels in every checkpoint, and nothing resets or under-counts it: not
a resume, not a changed recipe, not a step that failed halfway."""

from __future__ import annotations

import json
import pytest
import torch

from conftest import make_run, write_recipe
from dpregistry import UserError
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.privacy.accountant import Ledger, make_accountant
from dpregistry.privacy.events import Gaussian, PoissonSampled
from dpregistry.stages import Charge

STEPS, N, BATCH, CLIP = 20, 500, 25, 1.0


def started(tmp_path, **over):
    out = tmp_path / "run"
    out.mkdir()
    return make_run(recipe(**over), tmp_path, out=out)


def recipe(**over):
    r = {
        "algorithm": "dp_sgd",
        "objective": {"name": "quadratic", "dim": 3, "n": N, "n_test": 10},
        "sampler": {"name": "poisson", "batch_size": BATCH},
        "privatizer": {"clip": CLIP, "noise_multiplier": "auto"},
        "update": {"lr": 0.05},
        "accountant": "rdp",
        "privacy": {"epsilon": 2.0, "delta": 1e-5, "noise": "reproducible"},
        "train": {"steps": STEPS, "log_every": 5, "checkpoint_every": 5, "keep_checkpoints": 10, "progress": False},
    }
    for k, v in over.items():
        r[k] = {**r[k], **v} if isinstance(v, dict) and isinstance(r.get(k), dict) else v
    return r


def expected_epsilon(z: float, steps: int) -> float:
    """ε of ``steps`` Poisson-sampled releases at multiplier z, from a fresh accountant."""
    acc = make_accountant("rdp", {"epsilon": 2.0, "delta": 1e-5})
    return acc.epsilon(extra=[Charge(PoissonSampled(BATCH / N, Gaussian(std=z * CLIP, sensitivity=2 * CLIP)),
                                     count=steps)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = started(tmp_path_factory.mktemp("full"))
    summary = run.train()
    return run, summary


def test_plan_over_budget_is_refused_before_step_1(tmp_path):
    from typer.testing import CliRunner

    from dpregistry.cli import app

    with pytest.raises(UserError) as e:
        make_run(recipe(privatizer={"noise_multiplier": 0.3}), tmp_path)
    assert "the planned run spends ε =" in e.value.message and "more than the budget ε = 2" in e.value.message
    assert e.value.key == "privacy"
    # the CLI prints one line, exits 2 and writes nothing
    path = write_recipe(tmp_path, recipe(privatizer={"noise_multiplier": 0.3}), "over.yaml")
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out"), "-q"])
    assert res.exit_code == 2 and "more than the budget" in res.output
    assert not (tmp_path / "out").exists()
    # a ρ budget states its overspend in ρ
    with pytest.raises(UserError, match=r"ρ = .* more than the budget ρ = 0.001"):
        make_run(recipe(privatizer={"noise_multiplier": 5.0}, accountant="zcdp", privacy={"rho": 1e-3}), tmp_path)


def test_ledger_is_charged_every_step_and_matches_an_independent_count(uninterrupted):
    run, summary = uninterrupted
    entries = run.accountant.ledger.entries
    assert [(e["count"], e["first_step"], e["last_step"]) for e in entries] == [(STEPS, 0, STEPS - 1)]
    z = run.privatizer.noise_multiplier
    assert summary["epsilon"] == pytest.approx(expected_epsilon(z, STEPS), rel=1e-12)
    assert summary["epsilon"] <= 2.0 and summary["epsilon"] > 1.99  # calibrated: the budget is used
    rows = [json.loads(line) for line in (run.folder.metrics).read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    for r in rows:  # ε after k steps is the ε of k charges
        assert r["epsilon"] == pytest.approx(expected_epsilon(z, r["step"]), rel=1e-12)


def test_every_checkpoint_carries_the_ledger(uninterrupted):
    run, _ = uninterrupted
    for step, path in ckpt.list_checkpoints(run.folder.checkpoints):
        _, meta = ckpt.read(path)
        ledger = Ledger.from_json(meta["ledger"])
        assert ledger.n_charges == step
        assert meta["state"]["accountant"]["ledger"] == meta["ledger"]
        acc = make_accountant(meta["recipe"]["accountant"], meta["recipe"]["privacy"])
        acc.load_state_dict(meta["state"]["accountant"])
        if step:
            assert acc.epsilon() == pytest.approx(expected_epsilon(meta["noise_multiplier"], step), rel=1e-12)


def _stop_at(k):
    def progress(run, metrics):
        if run.step == k:
            run.stop_reason = "test stop"
    return progress


def test_resume_continues_the_ledger(uninterrupted, tmp_path):
    full, summary = uninterrupted
    run = started(tmp_path)
    run.train(progress=_stop_at(10))
    assert run.step == 10
    resumed = resume_run(tmp_path / "run", warn=lambda m: None)
    assert resumed.step == 10 and resumed.accountant.ledger.n_charges == 10  # restored, not reset
    assert resumed.epsilon() == pytest.approx(expected_epsilon(full.privatizer.noise_multiplier, 10), rel=1e-12)
    out = resumed.train()
    assert resumed.accountant.ledger.to_json() == full.accountant.ledger.to_json()
    assert out["epsilon"] == summary["epsilon"]
    assert all(torch.equal(resumed.params[k], full.params[k]) for k in full.params)


def test_a_changed_recipe_cannot_resume(tmp_path):
    run = started(tmp_path)
    run.train(progress=_stop_at(5))
    rpath = tmp_path / "run" / "recipe.json"
    stored = json.loads(rpath.read_text())
    # edited in place: the stored hash no longer matches
    edited = json.loads(json.dumps(stored))
    edited["recipe"]["privacy"]["epsilon"] = 20.0
    rpath.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="resolve this recipe differently"):
        resume_run(tmp_path / "run", warn=lambda m: None)
    # edited with a matching hash: the checkpoint was written by another recipe
    from dpregistry.recipe import recipe_hash

    edited["recipe_hash"] = recipe_hash(edited["recipe"])
    rpath.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="different recipe"):
        resume_run(tmp_path / "run", warn=lambda m: None)
    rpath.write_text(json.dumps(stored))
    assert resume_run(tmp_path / "run", warn=lambda m: None).accountant.ledger.n_charges == 5


def test_a_step_that_fails_halfway_is_never_under_counted(uninterrupted, tmp_path):
    """The update fails after the step's release was charged: the charge stays; the resumed run
    restarts from the last checkpoint, re-runs the step with the same noise, and ends with the
    ledger of the uninterrupted run (the unfinished release was never published)."""
    full, summary = uninterrupted
    run = started(tmp_path)
    apply = run.update_rule.apply

    def failing(params, release, r):
        if r.step == 12:
            raise RuntimeError("disk full")
        return apply(params, release, r)

    run.update_rule.apply = failing
    with pytest.raises(RuntimeError, match="disk full"):
        run.train()
    assert run.step == 12 and run.accountant.ledger.n_charges == 13  # step 12 was charged
    resumed = resume_run(tmp_path / "run", warn=lambda m: None)
    assert resumed.step == 10 and resumed.accountant.ledger.n_charges == 10
    out = resumed.train()
    assert resumed.accountant.ledger.to_json() == full.accountant.ledger.to_json()
    assert out["epsilon"] == summary["epsilon"]


def test_uniform_sampler_charges_sampling_without_replacement(tmp_path):
    """Fixed-size random batches are accounted with WBK19 (dp-accounting) under replace-one;
    the PLD accountant, which has no such analysis, is refused before step 1."""
    import dp_accounting as dpa

    from dpregistry.privacy.events import SampledWithoutReplacement

    run = make_run(recipe(sampler={"name": "uniform", "batch_size": BATCH}, train={"steps": 5}), tmp_path)
    run.train()
    (entry,) = run.accountant.ledger.entries
    assert entry["count"] == 5
    z = run.privatizer.noise_multiplier
    assert SampledWithoutReplacement.from_dict(entry["event"]) == SampledWithoutReplacement(
        N, BATCH, Gaussian(std=z * CLIP, sensitivity=2 * CLIP))
    direct = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    direct.compose(dpa.SampledWithoutReplacementDpEvent(N, BATCH, dpa.GaussianDpEvent(z / 2)), 5)
    assert run.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-12)
    assert all(len(run.sampler.indices(run.ctx.at(t)).unique()) == BATCH for t in range(3))
    with pytest.raises(UserError, match="cannot account 'sampled_without_replacement'") as refused:
        make_run(recipe(sampler={"name": "uniform", "batch_size": BATCH}, accountant="pld"), tmp_path)
    assert refused.value.key == "accountant" and refused.value.line is not None  # the recipe's accountant line
    with pytest.raises(UserError, match="replace-one"):
        make_run(recipe(sampler={"name": "uniform", "batch_size": BATCH}, privacy={"relation": "add_remove"}), tmp_path)


def test_restoring_a_ledger_drops_an_approval_made_without_it():
    """An approved plan lets its charges through unchecked; restoring a checkpoint's ledger must
    not keep an approval computed against another (here: empty) ledger."""
    from dpregistry import BudgetExhausted

    ev = PoissonSampled(BATCH / N, Gaussian(std=8.0, sensitivity=2 * CLIP))
    acc = make_accountant("rdp", {"epsilon": 2.0, "delta": 1e-5})
    n = 1
    while acc.fits([Charge(ev, count=2 * n)]):
        n *= 2
    acc.approve([Charge(ev, count=n)])  # fits alone, but not on top of a ledger that spent as much
    spent = make_accountant("rdp", {"epsilon": 2.0, "delta": 1e-5})
    spent.ledger.add(Charge(ev, count=n), 0)
    acc.load_state_dict(spent.state_dict())
    with pytest.raises(BudgetExhausted):
        acc.charge([Charge(ev, count=n)], 1)
