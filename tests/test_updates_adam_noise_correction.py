"""Adam's ``noise_correction`` (DP-AdamBC, Tang, Shpilevskiy, Lécuyer, AAAI 2024, arXiv 2312.14334):
the step against an independent computation of the paper's formula, the unchanged default, the
unchanged privacy, and the refusal where the privatizer states no noise."""

from __future__ import annotations

import math

import pytest
import torch

import dpregistry
from dpregistry import UserError, moments
from dpregistry.context import Context
from dpregistry.spaces import DenseAggregate
from dpregistry.stages import NoiseStd, Release
from dpreg_baseline.updates import Adam

BETAS = (0.8, 0.9)
SHAPES = {"w": (3, 4), "b": (5,)}


def _grads(steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Hand-made gradients in float64: each coordinate's scale differs by orders of magnitude, so
    that v̂ − Φ falls below the floor on some coordinates and far above it on others."""
    g = torch.Generator().manual_seed(seed)
    scale = {k: torch.logspace(-3, 0, math.prod(s), dtype=torch.float64).view(s) for k, s in SHAPES.items()}
    return [{k: scale[k] * torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
            for _ in range(steps)]


def _params() -> dict[str, torch.Tensor]:
    return {k: torch.linspace(-1, 1, math.prod(s), dtype=torch.float64).view(s).clone() for k, s in SHAPES.items()}


def _run(cfg: dict, grads, stds) -> tuple[dict[str, torch.Tensor], Adam]:
    params = _params()
    upd = Adam(Adam.Params(**cfg))
    ctx = Context.detached(params, provides={NoiseStd: NoiseStd()})
    upd.setup(ctx)
    upd.validate(ctx)
    for g, std in zip(grads, stds, strict=True):
        stats = {} if std is None else {"noise_std": std}
        upd.apply(ctx.params, Release(DenseAggregate({k: t.clone() for k, t in g.items()}), [], stats=stats), ctx)
    return params, upd


def _dp_adambc(grads, stds, lr, floor, weight_decay=0.0):
    """The paper's update, written out: m̂ = m/(1−β1^t), v̂ = v/(1−β2^t), x ← x − lr·m̂/√max(v̂ − Φ̄, γ'),
    with Φ̄ the β2-average of the releases' noise variances (Φ when it is constant). Returns the
    parameters and how many coordinate-steps were floored and how many were not."""
    b1, b2 = BETAS
    x = _params()
    m = {k: torch.zeros_like(t) for k, t in x.items()}
    v = {k: torch.zeros_like(t) for k, t in x.items()}
    floored = unfloored = 0
    for t, (g, std) in enumerate(zip(grads, stds, strict=True), start=1):
        phi = sum((1 - b2) * b2 ** (t - s) * stds[s - 1] ** 2 for s in range(1, t + 1)) / (1 - b2 ** t)
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
            corrected = v_hat - phi
            floored += int((corrected < floor).sum())
            unfloored += int((corrected > floor).sum())
            x[k] = x[k] * (1 - lr * weight_decay) - lr * m_hat / torch.sqrt(torch.clamp(corrected, min=floor))
    return x, floored, unfloored


@pytest.mark.parametrize("stds", [[0.05] * 6, [0.05, 0.2, 0.01, 0.1, 0.0, 0.05]], ids=["constant", "changing"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_step_is_dp_adambc_on_every_coordinate_floored_or_not(stds, weight_decay):
    grads = _grads(len(stds))
    cfg = {"lr": 1e-2, "betas": BETAS, "noise_correction": True, "variance_floor": 1e-4, "weight_decay": weight_decay}
    got, upd = _run(cfg, grads, stds)
    want, floored, unfloored = _dp_adambc(grads, stds, 1e-2, 1e-4, weight_decay)
    assert floored > 20 and unfloored > 20  # both branches of the max are exercised
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)
    assert upd.state.noise_var / (1 - BETAS[1] ** len(stds)) == pytest.approx(
        sum((1 - BETAS[1]) * BETAS[1] ** (len(stds) - s) * stds[s - 1] ** 2 for s in range(1, len(stds) + 1))
        / (1 - BETAS[1] ** len(stds)), rel=1e-12)


def test_without_noise_the_correction_is_adam_with_a_floor_in_place_of_eps():
    """Φ = 0: with a floor and an eps far below every √v̂ both forms take Adam's step."""
    grads = [{k: t + 0.5 * torch.sign(t) for k, t in g.items()} for g in _grads(4)]  # |g| ≥ 0.5
    bc, _ = _run({"lr": 1e-2, "betas": BETAS, "noise_correction": True, "variance_floor": 1e-60}, grads, [0.0] * 4)
    adam, _ = _run({"lr": 1e-2, "betas": BETAS, "eps": 1e-30}, grads, [0.0] * 4)
    for k in bc:
        torch.testing.assert_close(bc[k], adam[k], rtol=1e-13, atol=1e-15)


def test_with_the_option_off_the_step_is_the_old_arithmetic_bit_for_bit():
    """The default path is unchanged: x − α_t·m/(√v + eps) as whole-tensor operations, in float32,
    and a release's noise_std is ignored."""
    grads = [{k: t.float() for k, t in g.items()} for g in _grads(3)]
    params = {k: t.float() for k, t in _params().items()}
    upd = Adam(Adam.Params(lr=1e-2, betas=BETAS))
    assert upd.needs == ()
    ctx = Context.detached(params)
    m = {k: torch.zeros_like(t) for k, t in params.items()}
    v = {k: torch.zeros_like(t) for k, t in params.items()}
    want = {k: t.clone() for k, t in params.items()}
    for t, g in enumerate(grads, start=1):
        upd.apply(ctx.params, Release(DenseAggregate({k: x.clone() for k, x in g.items()}), [],
                                      stats={"noise_std": 0.3}), ctx)
        alpha = 1e-2 * math.sqrt(1 - BETAS[1] ** t) / (1 - BETAS[0] ** t)
        for k in want:
            m[k].mul_(BETAS[0]).add_(g[k], alpha=1 - BETAS[0])
            v[k].mul_(BETAS[1]).addcmul_(g[k], g[k], value=1 - BETAS[1])
            want[k] -= m[k] / (v[k].sqrt() + 1e-8) * alpha
    for k in want:
        assert torch.equal(params[k], want[k]), k
    assert upd.state.noise_var == 0.0


def test_the_corrected_step_in_blocks_is_the_whole_tensor_step_bit_for_bit(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x, m, v = torch.randn(120, generator=g), torch.randn(120, generator=g), torch.rand(120, generator=g)
    noise = (0.3, 0.5, 1e-3)  # v/0.3 − 0.5 is below the floor on about 15 % of the elements
    expect = x - moments.noise_corrected_ratio(m, v, *noise) * 0.01
    assert torch.equal(moments.noise_corrected_ratio(m, v, *noise),
                       m / torch.sqrt(torch.clamp(v / 0.3 - 0.5, min=1e-3)))
    monkeypatch.setattr(moments, "BLOCK", 7)
    moments.sub_ratio_(x, m, v, 0.0, 0.01, noise)
    assert torch.equal(x, expect)


def test_a_floor_without_the_correction_is_refused():
    with pytest.raises(ValueError, match="variance_floor applies only with noise_correction"):
        Adam.Params(lr=1e-2, variance_floor=1e-6)
    on = Adam.Params(lr=1e-2, noise_correction=True)
    assert on.floor == 1e-8 and Adam(on).needs == (NoiseStd,)
    # a resolved recipe (every default written out) reads back as the same settings
    assert Adam.Params(**on.model_dump()) == on
    assert Adam.Params(**Adam.Params(lr=1e-2).model_dump()).floor == 1e-8


SMALL = ["privacy.noise=reproducible", "train.steps=6", "train.eval_every=null", "train.checkpoint_every=null",
         "sampler.batch_size=64", "objective.model.hidden=[16]"]


def test_the_privacy_is_unchanged_and_phi_is_the_privatizers_noise_on_the_mean():
    """Post-processing: the same run with and without the correction charges the same ledger and ε
    at the same calibrated noise; only the parameters move differently. Φ is the
    privatizer's (σ·C/E[B])², from its calibrated noise multiplier and clip."""
    off = dpregistry.train("quickstart", set=SMALL, verbose=False)
    on = dpregistry.train("quickstart", set=SMALL + ["update.noise_correction=true", "update.variance_floor=1e-6"],
                          verbose=False)
    assert on.ledger == off.ledger and on.epsilon == off.epsilon and on.epsilon is not None
    assert on.summary["noise_multiplier"] == off.summary["noise_multiplier"]
    assert any(not torch.equal(a, b) for a, b in zip(on.run.params.values(), off.run.params.values()))
    priv, upd = on.run.privatizer, on.run.update_rule
    phi = (priv.noise_multiplier * priv.cfg.clip / 64) ** 2
    assert upd.state.noise_var / (1 - upd.cfg.betas[1] ** 6) == pytest.approx(phi, rel=1e-12)


def test_a_privatizer_that_states_no_noise_is_refused_before_anything_is_written(tmp_path):
    recipe = {"algorithm": "dp_adam", "seed": 0,
              "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [8]},
                            "data": {"dataset": "digits", "test_fraction": 0.2, "seed": 0}},
              "sampler": {"name": "poisson", "batch_size": 64}, "privatizer": {"name": "none"},
              "update": {"lr": 0.02, "noise_correction": True}, "privacy": {"epsilon": None},
              "train": {"steps": 2}}
    with pytest.raises(UserError, match="update_rule 'adam' needs NoiseStd.*privatizer gaussian") as e:
        dpregistry.train(recipe, out=tmp_path / "run", verbose=False)
    assert e.value.key == "update"
    assert not (tmp_path / "run").exists()
    recipe["update"]["noise_correction"] = False  # the same recipe without the correction runs
    assert dpregistry.train(recipe, verbose=False).summary["step"] == 2


def test_a_resumed_corrected_run_is_the_straight_run_bit_for_bit(tmp_path):
    """The moving average of Φ is checkpointed with the moments: a crash and a resume change nothing."""
    from conftest import crash_at, make_run
    from dpregistry.folder import resume_run
    from test_core_engine import RECIPE

    recipe = {**RECIPE, "update": {"lr": 0.01, "noise_correction": True, "variance_floor": 1e-4},
              "train": {"steps": 8, "checkpoint_every": 3}}
    straight = make_run(recipe, tmp_path, out=tmp_path / "a")
    straight.train()
    crash_at(make_run(recipe, tmp_path, out=tmp_path / "b"), 5)
    resumed = resume_run(tmp_path / "b")
    assert resumed.step == 3 and resumed.update_rule.state.noise_var > 0
    resumed.train()
    assert all(torch.equal(straight.params[k], resumed.params[k]) for k in straight.params)
    assert resumed.update_rule.state.noise_var == straight.update_rule.state.noise_var


def test_kl_scheduled_gaussian_states_the_noise_on_its_release_and_spider_does_not_claim_to():
    """scheduled_gaussian provides NoiseStd: the noise_std its release states (std/n) is the std of
    the noise on the released value, measured on 200,000 coordinates of a zero sum (within 1 %).
    SPIDER's release is the running sum of a round's noisy queries, whose noise is not the last
    query's: it provides no NoiseStd, so a noise-correcting Adam is refused with it."""
    from dpreg_kl.privatizers import ScheduledGaussian, SpiderGaussian

    from dpregistry.spaces import DenseAggregate
    from dpregistry.stages import ClippedSum

    zero = {"w": torch.zeros(200_000, dtype=torch.float64)}
    ctx = Context.detached(zero, expected_batch_size=40.0)
    priv = ScheduledGaussian(ScheduledGaussian.Params(clip=1.0))
    priv.setup(ctx)
    assert NoiseStd in ScheduledGaussian.provides and isinstance(priv.provide(NoiseStd), NoiseStd)
    release = priv.release(ClippedSum(DenseAggregate({"w": zero["w"].clone()})), ctx, std=3.0)
    assert release.stats["noise_std"] == 3.0 / 40
    assert float(release.value.tensors["w"].std()) == pytest.approx(3.0 / 40, rel=0.01)
    assert NoiseStd not in SpiderGaussian.provides
