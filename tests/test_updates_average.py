"""``average`` of ``adam`` and ``sgd``: the run outputs the iterates' exponential moving average (post-processing).
Checked against the weighted mean written out, for privacy (the same ledger and noise as without
it), through a crash and a resume, and in the model a run writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import dpregistry
from dpregistry.context import Context
from dpregistry.spaces import DenseAggregate
from dpregistry.stages import Release
from dpreg_baseline.updates import SGD, Adam
from test_updates_adam_noise_correction import SMALL  # a six-step quickstart


@pytest.mark.parametrize("rule", [Adam, SGD])
def test_the_output_is_the_bias_corrected_moving_average_of_the_iterates_and_the_iterate_is_untouched(rule):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    plain = {"w": params["w"].clone()}
    beta, steps = 0.7, 6
    with_avg, without = rule(rule.Params(lr=0.05, average=beta)), rule(rule.Params(lr=0.05))
    ctx, ctx_plain = Context.detached(params), Context.detached(plain)
    with_avg.setup(ctx), without.setup(ctx_plain)
    assert with_avg.output(params, ctx) is None  # no step taken: the iterate is the output
    iterates = []
    for _ in range(steps):
        grad = torch.randn(4, 3, generator=g, dtype=torch.float64)
        with_avg.apply(ctx.params, Release(DenseAggregate({"w": grad.clone()}), []), ctx)
        without.apply(ctx_plain.params, Release(DenseAggregate({"w": grad.clone()}), []), ctx_plain)
        iterates.append(params["w"].clone())
    assert torch.equal(params["w"], plain["w"])  # the steps themselves do not change
    weights = [(1 - beta) * beta ** (steps - i) for i in range(1, steps + 1)]
    want = sum(w * x for w, x in zip(weights, iterates)) / sum(weights)  # sum(weights) = 1 − β^t
    torch.testing.assert_close(with_avg.output(params, ctx)["w"], want, rtol=1e-13, atol=1e-15)
    assert without.output(plain, ctx_plain) is None


@pytest.mark.parametrize("rule", [Adam, SGD])
def test_a_decay_outside_zero_to_one_is_refused(rule):
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="average"):
            rule.Params(lr=1e-2, average=bad)


def test_the_privacy_is_unchanged_and_the_written_model_is_the_average(tmp_path):
    off = dpregistry.train("quickstart", set=SMALL, verbose=False)
    on = dpregistry.train("quickstart", set=SMALL + ["update.average=0.8"], out=tmp_path / "run", verbose=False)
    assert on.ledger == off.ledger and on.epsilon == off.epsilon and on.epsilon is not None
    assert on.summary["noise_multiplier"] == off.summary["noise_multiplier"]
    upd = on.run.update_rule
    average = {k: a / (1 - 0.8 ** 6) for k, a in upd.state.average.items()}
    written = load_file(str(tmp_path / "run" / "model.safetensors"))
    for k, a in average.items():
        assert torch.equal(on.run.params[k], a.to(on.run.params[k].dtype))  # what the final metrics scored
        assert torch.equal(written[k], on.run.params[k])
        assert not torch.equal(on.run.params[k], off.run.params[k])  # off's last iterate is not its average


def test_a_resumed_averaging_run_is_the_straight_run_bit_for_bit(tmp_path):
    """The average is checkpointed with the moments: a crash and a resume change nothing."""
    from conftest import crash_at, make_run
    from dpregistry.folder import resume_run
    from test_core_engine import RECIPE

    recipe = {**RECIPE, "update": {"lr": 0.01, "average": 0.9}, "train": {"steps": 8, "checkpoint_every": 3}}
    straight = make_run(recipe, tmp_path, out=tmp_path / "a")
    straight.train()
    crash_at(make_run(recipe, tmp_path, out=tmp_path / "b"), 5)
    resumed = resume_run(tmp_path / "b")
    assert resumed.step == 3 and resumed.update_rule.state.average
    resumed.train()
    for k in straight.params:
        assert torch.equal(straight.params[k], resumed.params[k])
        assert torch.equal(straight.update_rule.state.average[k], resumed.update_rule.state.average[k])


@pytest.mark.parametrize("algorithm,update", [("dp_sgd", {"lr": 0.1}), ("dp_adam", {"lr": 3e-3}),
                                               ("dp_grape", {"lr": 3e-3})], ids=["sgd", "adam", "projected_adam"])
def test_every_averaging_rule_outputs_the_moving_average_of_the_iterates_it_took(algorithm, update, tmp_path):
    """End to end, for each rule that offers ``average``: the iterates seen after every step of a
    run, averaged independently in float64, are the parameters the run outputs."""
    from conftest import make_run
    from test_grape import digits

    beta, steps = 0.75, 5
    extra = {"estimator": {"rank": 8}} if algorithm == "dp_grape" else {}
    run = make_run(digits(algorithm, steps, update={**update, "average": beta}, **extra), tmp_path)
    iterates = []
    out = run.train(progress=lambda r, metrics: iterates.append({k: v.detach().double().clone()
                                                                 for k, v in r.params.items()}))
    assert len(iterates) == steps and out["step"] == steps
    weights = [(1 - beta) * beta ** (steps - i) for i in range(1, steps + 1)]
    for k, x in run.output_params().items():
        want = sum(w * it[k] for w, it in zip(weights, iterates)) / sum(weights)
        torch.testing.assert_close(x.double(), want, rtol=1e-5, atol=1e-6)
        assert not torch.equal(x, iterates[-1][k].to(x.dtype))
