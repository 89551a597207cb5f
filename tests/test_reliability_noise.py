"""Reproducibility and secure noise.

Reproducible mode (privacy.noise: reproducible): the same recipe and seed give bit-identical runs
(parameters, checkpoints, metrics). Secure mode (the default): every privacy-noise sample, and the
secret batch sampling that amplification rests on, comes from a fresh OS-entropy key, so they
differ between runs, while everything public still reproduces: the directions, the
initialisation, and the clipped sum of a given batch before noise.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_run, write_recipe
from dpregistry import checkpoint as ckpt
from test_core_cli import dpreg

FIRST_ORDER = {
    "seed": 7,
    "algorithm": "dp_adam",
    "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [16]}, "data": {"dataset": "wine"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 1.2},
    "update": {"lr": 0.01},
    "accountant": "rdp",
    "privacy": {"epsilon": 50.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 6, "log_every": 2, "eval_every": 3, "checkpoint_every": 2, "keep_checkpoints": 10,
              "progress": False},
}
ZEROTH_ORDER = dict(FIRST_ORDER, algorithm="standard", estimator={"name": "zo_two_point", "lambda": 1e-3},
                    privatizer={"name": "gaussian", "clip": 2.0, "noise_multiplier": 1.2},
                    update={"name": "directional_sgd", "lr": 1e-3})


def secure(recipe):
    return dict(recipe, privacy=dict(recipe["privacy"], noise="secure"))


def record(run):
    """Run to the end, recording what each step saw: batch, directions, clipped sum, noise."""
    log = {"init": {k: v.detach().clone() for k, v in run.params.items()}, "batches": [], "directions": [],
           "clipped": [], "noise": []}
    sampler_indices, contributions, clip_sum, noise = (run.sampler.indices, run.estimator.contributions,
                                                       run.privatizer.clip_sum, run.rng.noise)

    def indices(ctx):
        idx = sampler_indices(ctx)
        log["batches"].append(idx.clone())
        return idx

    def contribs(objective, idx, r):
        for c in contributions(objective, idx, r):
            if getattr(c, "direction", None) is not None:
                log["directions"].append(c.direction.seed)
            yield c

    def clipped(c):
        total = clip_sum(c)
        log["clipped"].append({k: v.clone() for k, v in total.aggregate.tensors.items()})
        return total

    class Recording:
        def __init__(self, src):
            self.src = src

        def randn(self, *a, **k):
            z = self.src.randn(*a, **k)
            log["noise"].append(z.clone())
            return z

    run.sampler.indices, run.estimator.contributions, run.privatizer.clip_sum = indices, contribs, clipped
    run.rng.noise = lambda step, call: Recording(noise(step, call))
    run.train()
    log["final"] = {k: v.detach().clone() for k, v in run.params.items()}
    return log


def equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("recipe", [FIRST_ORDER, ZEROTH_ORDER], ids=["first_order", "zeroth_order"])
def test_reproducible_mode_reproduces_everything_bit_for_bit(recipe, tmp_path):
    a, b = record(make_run(recipe, tmp_path)), record(make_run(recipe, tmp_path))
    assert a["noise"] and equal(a, b)


@pytest.mark.parametrize("recipe", [FIRST_ORDER, ZEROTH_ORDER], ids=["first_order", "zeroth_order"])
def test_secure_mode_reproduces_everything_but_the_noise(recipe, tmp_path):
    a, b = record(make_run(secure(recipe), tmp_path)), record(make_run(secure(recipe), tmp_path))
    default = record(make_run(recipe, tmp_path))
    # public randomness: the same as each other and as the default mode
    for key in ("init", "directions"):
        assert equal(a[key], b[key]) and equal(a[key], default[key]), key
    assert len(a["batches"]) == 6 and (recipe is FIRST_ORDER or len(a["directions"]) == 6)
    # Poisson batches are as secret as the noise: amplification by sampling assumes nobody can
    # regenerate them from the recipe (tests/test_core_review.py)
    assert not equal(a["batches"], b["batches"]) and not equal(a["batches"], default["batches"])
    # the first clipped sum (same parameters) is what the default mode clips on that batch; the noise is not
    fresh = make_run(recipe, tmp_path)
    again = fresh.privatize_batch(a["batches"][0]).aggregate.tensors
    fresh.ctx.undo_displacement()
    assert equal(a["clipped"][0], {k: v.clone() for k, v in again.items()})
    assert len(a["noise"]) == len(b["noise"]) == len(default["noise"]) == 6 * (1 if a["directions"] else len(a["init"]))
    for x, y, z in zip(a["noise"], b["noise"], default["noise"]):
        assert x.shape == y.shape == z.shape and x.dtype == z.dtype
        assert not torch.equal(x, y) and not torch.equal(x, z)
    assert not equal(a["final"], b["final"])


def test_two_cli_runs_write_identical_files(tmp_path):
    recipe = write_recipe(tmp_path, FIRST_ORDER)
    for name in ("a", "b"):
        assert dpreg("run", recipe, "--out", tmp_path / name, "-q").returncode == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    for (sa, pa), (sb, pb) in zip(ckpt.list_checkpoints(a / "checkpoints"), ckpt.list_checkpoints(b / "checkpoints")):
        assert sa == sb and pa.read_bytes() == pb.read_bytes()
    rows = [[{k: v for k, v in json.loads(x).items() if k != "wall_seconds"}
             for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    assert rows[0] == rows[1]
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert {k: v for k, v in sa.items() if k != "wall_seconds"} == {k: v for k, v in sb.items() if k != "wall_seconds"}
    assert {"dpregistry", "torch", "python", "plugins"} <= set(sa["versions"])
    assert any("baseline" in p for p in sa["versions"]["plugins"])


def test_secure_mode_writes_no_noise_key_and_checkpoints_before_publishing_eval_metrics(tmp_path):
    out = tmp_path / "out"
    recipe = secure(dict(FIRST_ORDER, train=dict(FIRST_ORDER["train"], checkpoint_every=None)))
    run = make_run(recipe, tmp_path, out=out)
    key = run.rng.key
    run.train()
    for p in out.rglob("*"):
        if p.is_file():
            assert key not in p.read_bytes() and key.hex().encode() not in p.read_bytes()
    # eval rows (at steps 3 and 6) reveal releases: in secure mode their step is checkpointed (and
    # charged) first, since a resume would redraw the noise of steps after its checkpoint
    steps = [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")]
    assert steps == [0, 3, 6]
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "eval/accuracy" in r] == [0, 3, 6]  # step 0: the untrained baseline, no release in it


def test_the_secure_noise_has_the_calibrated_scale_in_a_release(tmp_path):
    run = make_run(secure(FIRST_ORDER), tmp_path)
    priv = run.privatizer
    zero = {k: torch.zeros((1,) + tuple(v.shape)) for k, v in run.params.items()}
    from dpregistry.clipping import clip_and_sum
    from dpregistry.spaces import DenseContribution

    total = clip_and_sum(DenseContribution(per_example=zero), 1.0)
    draws = []
    for step in range(300):
        run.step = step
        t = total.__class__(total.aggregate.clone(), count=1)
        draws.append(torch.cat([v.flatten() for v in priv.release(t, run.begin_step()).value.tensors.values()]))
    z = torch.cat(draws)
    expected = 1.2 * 1.0 / run.sampler.expected_batch_size(run.ctx)  # z·C on the sum, over the batch size
    assert abs(z.std().item() / expected - 1) < 5 / (2 * len(z)) ** 0.5  # 5 standard errors
