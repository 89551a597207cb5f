"""Privacy-noise modes: seeded (reproducible, not secret), keyed (secret key), secure (OS entropy)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_run
from dpregistry.engine import resume_run
from dpregistry.errors import UserError
from dpregistry.rng import NOISE_KEY_ENV, RunRNG

RECIPE = {
    "seed": 2,
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 2.0},
    "privacy": {"epsilon": 50.0, "delta": 1e-3},
    "train": {"steps": 6, "checkpoint_every": 3, "keep_checkpoints": 5},
}


def final(run):
    run.train()
    return {k: v.detach().clone() for k, v in run.params.items()}


def test_keyed_noise_is_secret_and_reproducible_for_the_key_holder(tmp_path, monkeypatch):
    seeded = RunRNG(7).noise(3).randn((100,))
    a = RunRNG(7, noise_key="s3cret").noise(3).randn((100,))
    assert not torch.equal(a, seeded)  # the recipe seed alone no longer gives the noise
    assert torch.equal(a, RunRNG(7, noise_key="s3cret").noise(3).randn((100,)))
    assert not torch.equal(a, RunRNG(7, noise_key="other").noise(3).randn((100,)))
    assert RunRNG(7, noise_key="s3cret").noise_fingerprint != RunRNG(7, noise_key="other").noise_fingerprint
    assert "s3cret" not in RunRNG(7, noise_key="s3cret").noise_fingerprint

    monkeypatch.setenv(NOISE_KEY_ENV, "s3cret")
    one, two = final(make_run(RECIPE, tmp_path)), final(make_run(RECIPE, tmp_path))
    assert all(torch.equal(one[k], two[k]) for k in one)
    monkeypatch.delenv(NOISE_KEY_ENV)
    plain = final(make_run(RECIPE, tmp_path))
    assert not all(torch.equal(one[k], plain[k]) for k in one)


def test_a_keyed_run_resumes_only_with_its_key(tmp_path, monkeypatch):
    monkeypatch.setenv(NOISE_KEY_ENV, "k1")
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    straight = final(run)
    assert run.rng.noise_mode == "keyed"
    monkeypatch.delenv(NOISE_KEY_ENV)
    with pytest.raises(UserError, match="DPREG_NOISE_KEY"):
        resume_run(tmp_path / "r")
    monkeypatch.setenv(NOISE_KEY_ENV, "k2")
    with pytest.raises(UserError, match="same secret key"):
        resume_run(tmp_path / "r")
    monkeypatch.setenv(NOISE_KEY_ENV, "k1")
    r = resume_run(tmp_path / "r")
    assert r.step == 6 and all(torch.equal(straight[k], r.params[k]) for k in straight)


def test_summary_states_the_noise_mode(tmp_path):
    import json

    make_run(RECIPE, tmp_path, out=tmp_path / "r").train()
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["noise"] == "seeded"
