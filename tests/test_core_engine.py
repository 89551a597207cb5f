"""Engine: budget enforcement, bitwise resume, checkpoints, ledger continuity."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import crash_at, make_run, write_recipe
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.errors import UserError
from dpregistry.recipe import load

RECIPE = {
    "seed": 3,
    "algorithm": "dp_adam",
    "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [16]}, "data": {"dataset": "wine"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": "auto"},
    "update": {"lr": 0.01},
    "privacy": {"epsilon": 8.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 12, "log_every": 2, "checkpoint_every": 3, "keep_checkpoints": 10},
}


def params_of(run):
    return {k: v.detach().clone() for k, v in run.params.items()}


def test_straight_run_equals_half_run_plus_resume_bitwise(tmp_path):
    a = make_run(RECIPE, tmp_path, out=tmp_path / "a")
    sa = a.train()
    # the same run, crashing at step 8: the checkpoint at step 6 is the newest
    crash_at(make_run(RECIPE, tmp_path, out=tmp_path / "b"), 8)
    r = resume_run(tmp_path / "b")
    assert r.step == 6
    sb = r.train()
    pa, pb = params_of(a), params_of(r)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert sa["epsilon"] == sb["epsilon"] and sa["step"] == sb["step"] == 12
    # the ledger after resume is the straight run's ledger, charge for charge
    assert a.accountant.ledger.to_json() == r.accountant.ledger.to_json()
    assert a.accountant.ledger.n_charges == 12
    # metrics logged after the checkpoint the resume started from were dropped, then re-logged
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


def test_resume_continues_the_ledger_and_never_resets_it(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    run.train()
    eps_before = run.epsilon()
    r = resume_run(tmp_path / "r")
    assert r.step == 12 and r.accountant.ledger.n_charges == 12
    assert r.epsilon() == eps_before > 0


def test_resume_refuses_a_checkpoint_of_another_recipe(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    run.train()
    tensors, meta, _ = ckpt.latest_valid(tmp_path / "r" / "checkpoints")
    other = make_run(RECIPE, tmp_path, sets=["privatizer.clip=2.0"])
    with pytest.raises(UserError, match="different recipe"):
        other.load_state(tensors, meta)


def test_resume_refuses_a_recipe_folder_that_changed(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    run.train()
    rj = tmp_path / "r" / "recipe.json"
    stored = json.loads(rj.read_text())
    stored["recipe"]["train"]["steps"] = 40  # more steps = more privacy spent: must not sneak in
    rj.write_text(json.dumps(stored))
    with pytest.raises(UserError, match="resolve"):
        resume_run(tmp_path / "r")


def test_plan_over_budget_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(UserError, match="planned run spends") as e:
        make_run(RECIPE, tmp_path, sets=["privatizer.noise_multiplier=0.3"])
    assert e.value.key == "privacy"


def test_calibrated_noise_meets_the_budget_tightly(tmp_path):
    run = make_run(RECIPE, tmp_path)
    z = run.privatizer.noise_multiplier
    plan = run.algorithm.plan(run.ctx, z)
    eps = run.accountant.epsilon(extra=plan)
    assert eps <= 8.0 and eps > 8.0 * 0.999
    assert run.accountant.epsilon(extra=run.algorithm.plan(run.ctx, z * 0.99)) > 8.0


def test_every_step_is_charged(tmp_path):
    run = make_run(RECIPE, tmp_path, sets=["train.steps=5"])
    run.train()
    [entry] = run.accountant.ledger.to_json()
    assert entry["count"] == 5 and entry["first_step"] == 0 and entry["last_step"] == 4
    assert entry["event"]["type"] == "poisson_sampled"


def test_a_step_that_fails_halfway_is_not_applied(tmp_path):
    run = make_run(RECIPE, tmp_path)
    before = params_of(run)
    real = run.objective.batch_losses

    def boom(idx):
        raise RuntimeError("injected fault in the forward pass")

    run.objective.batch_losses = boom
    with pytest.raises(RuntimeError, match="injected"):
        run.train()
    assert run.step == 0 and run.accountant.ledger.n_charges == 0
    assert all(torch.equal(before[k], v) for k, v in params_of(run).items())
    run.objective.batch_losses = real


def test_zeroth_order_displacement_is_undone_when_a_step_fails(tmp_path):
    recipe = dict(RECIPE, algorithm="standard", sampler={"name": "shuffle", "batch_size": 8},
                  estimator={"name": "zo_two_point", "lambda": 0.1},
                  privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": 2.0},
                  update={"name": "directional_sgd", "lr": 0.01}, accountant="rdp",
                  privacy={"epsilon": 50.0, "delta": 1e-3})
    run = make_run(recipe, tmp_path)
    before = params_of(run)
    calls = {"n": 0}
    real = run.objective.batch_losses

    def second_forward_fails(idx):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(idx)

    run.objective.batch_losses = second_forward_fails
    with pytest.raises(RuntimeError):
        run.train()
    for k, v in params_of(run).items():  # x + λu − 2λu + λu, equal up to float rounding
        assert torch.allclose(v, before[k], atol=1e-6)
    assert run.accountant.ledger.n_charges == 0


def test_corrupted_checkpoint_is_skipped_with_a_warning(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    run.train()
    cks = ckpt.list_checkpoints(tmp_path / "r" / "checkpoints")
    newest = cks[-1][1]
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF  # flip a bit in the tensor payload
    newest.write_bytes(bytes(data))
    warnings = []
    tensors, meta, path = ckpt.latest_valid(tmp_path / "r" / "checkpoints", warn=warnings.append)
    assert path == cks[-2][1] and meta["step"] == cks[-2][0]
    assert warnings and "checksum" in warnings[0]
    # a truncated file is skipped too
    cks[-2][1].write_bytes(cks[-2][1].read_bytes()[:100])
    _, meta, _ = ckpt.latest_valid(tmp_path / "r" / "checkpoints", warn=warnings.append)
    assert meta["step"] == cks[-3][0]


def test_pickle_files_are_refused(tmp_path):
    import pickle

    bad = tmp_path / "evil.safetensors"
    bad.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ckpt.CorruptCheckpoint):
        ckpt.read(bad)
    with pytest.raises(UserError, match="pickle"):
        ckpt.require_safetensors(bad)


def test_random_iterate_output_is_a_visited_iterate(tmp_path):
    run = make_run(RECIPE, tmp_path, sets=["output=random_iterate", "train.steps=6"])
    seen = []
    real = run.update_rule.apply

    def record(params, release, r):
        seen.append({k: v.detach().clone() for k, v in params.items()})
        return real(params, release, r)

    run.update_rule.apply = record
    run.train()
    final = params_of(run)
    assert any(all(torch.equal(final[k], s[k]) for k in final) for s in seen)


def test_recipe_and_run_reproduce_bitwise(tmp_path):
    a = make_run(RECIPE, tmp_path)
    a.train()
    b = make_run(RECIPE, tmp_path)
    b.train()
    assert all(torch.equal(v, params_of(b)[k]) for k, v in params_of(a).items())
    c = make_run(RECIPE, tmp_path, sets=["seed=4"])
    c.train()
    assert not all(torch.equal(v, params_of(c)[k]) for k, v in params_of(a).items())


def test_recipe_loads_without_touching_the_registry_twice(tmp_path):
    path = write_recipe(tmp_path, RECIPE)
    assert load(path).hash == load(path).hash
