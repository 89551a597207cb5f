"""Every long wait talks, and a second Ctrl-C stops sooner without losing the ledger (issue 17)."""

from __future__ import annotations

import json
import os
import signal

import torch

from conftest import make_run
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run

RECIPE = {
    "seed": 5,
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 2.0},
    "privacy": {"epsilon": 50.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 8, "log_every": 1, "eval_every": 3, "checkpoint_every": 2, "keep_checkpoints": 10,
              "progress": False},
}


def finished(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "straight")
    run.train()
    return {k: v.clone() for k, v in run.params.items()}, run.accountant.ledger.to_json()


def same_as_straight(out, straight):
    params, ledger = straight
    run = resume_run(out)
    run.train()
    assert all(torch.equal(params[k], run.params[k]) for k in params)
    assert run.accountant.ledger.to_json() == ledger


def test_the_first_signal_says_at_once_that_the_run_stops_after_the_step(tmp_path, capsys):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    real = run.algorithm.step

    def step(r):
        if r.step == 4:
            os.kill(os.getpid(), signal.SIGINT)  # mid-step: the step finishes, then the run stops
        return real(r)

    run.algorithm.step = step
    summary = run.train()
    said = capsys.readouterr().err
    assert "SIGINT: stopping after the current step" in said
    assert summary["step"] == 5 and summary["stopped"] == "stopped by SIGINT"
    assert ckpt.list_checkpoints(tmp_path / "r" / "checkpoints")[-1][0] == 5
    same_as_straight(tmp_path / "r", finished(tmp_path))


def test_a_second_signal_interrupts_an_evaluation_and_keeps_the_step_it_follows(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    real = run.objective.evaluate
    calls = {"n": 0}

    def slow_evaluation():
        calls["n"] += 1
        if run.step == 6:  # the second evaluation: two signals, as an impatient user sends
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            raise AssertionError("the evaluation went on after the second signal")
        return real()

    run.objective.evaluate = slow_evaluation
    summary = run.train()
    assert summary["stopped"] == "interrupted by SIGINT after step 6" and summary["metrics"] == {}
    assert run.stop_signal == signal.SIGINT
    # step 6 was taken whole: it is checkpointed, so its charge is on disk with it
    _, meta = ckpt.read(ckpt.checkpoint_path(tmp_path / "r" / "checkpoints", 6))
    assert meta["ledger"][0]["count"] == 6
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["step"] == 6
    same_as_straight(tmp_path / "r", finished(tmp_path))


def test_a_second_signal_inside_a_step_writes_nothing_of_it(tmp_path):
    run = make_run(RECIPE, tmp_path, out=tmp_path / "r")
    real = run.update_rule.apply

    def apply(params, release, ctx):
        if ctx.step == 3:  # after the charge, before the update: half a step
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(params, release, ctx)

    run.update_rule.apply = apply
    summary = run.train()
    assert summary["stopped"] == "interrupted by SIGINT during step 4" and run.stop_signal == signal.SIGINT
    # the half-done step left nothing: the newest checkpoint (step 2) is the state, and its ledger
    # covers every release that was written down
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "r" / "checkpoints")] == [0, 2]
    assert not (tmp_path / "r" / "summary.json").exists()
    same_as_straight(tmp_path / "r", finished(tmp_path))
