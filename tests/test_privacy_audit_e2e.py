"""End-to-end privacy audits: five mechanisms as a recipe builds them, and three ways to break each
(per-layer clipping has a fourth: a bound of C per layer, ``test_audit_catches_a_per_layer_bound_of_c``).

Each audit prepares a real run (sampler, estimator, clipping, privatizer, calibration and
accountant, as a user gets them) whose objective holds two neighbouring data sets, D and D' (the
canary replaces one record), releases many times on each, and bounds ε from below with
Clopper–Pearson (:mod:`dpregistry.audit`). The honest mechanism must never be caught above the ε
that its own accountant claims for the release it made; each broken variant must be:

* ``noise_halved``: the noise source returns half the noise that the release's events declare;
* ``sensitivity_c``: the privatizer takes the clipped sum's sensitivity as C under replace-one
  (it is 2C), so the run calibrates half the noise and the accountant believes the events;
* ``clip_skipped``: the last example of a clipped batch keeps its norm (an off-by-one in the
  clip weights), and the canary's slot is the last example.

The neighbouring data sets (objective ``audit_canary``) put the canary where it is most
distinguishable: no other record uses the model's last input feature, so the slot's gradient is
orthogonal to every other record's, and the slot holds opposite gradients in D and D' (target +v,
then −v), which clipping maps to ±C: the clipped sums differ by 2C, the replace-one worst case.

Releases are vectorised without leaving the stages' code: the estimator and the clipping run on
the real batches; :func:`dpregistry.audit.trial_sums` stacks the trials' clipped sums and one call
of the privatizer's own ``release`` noises and divides them all (Poisson batches: each record is
clipped on its own, as a micro-batch, and trial t adds up the records its sampled batch holds; the
test checks this sum against the engine's ``privatize_batch`` of the same batch). Noise is
reproducible (seeded) and every trial count is fixed, so each audit is deterministic.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
from pydantic import Field
from torch import nn

import dpregistry.clipping
import dpreg_nonsmooth.privatizers
from conftest import make_run
from dpregistry import StagePlugin, StageParams
from dpregistry.audit import epsilon_lower_bound, projections, trial_sums
from dpregistry.objectives import TorchObjective
from dpregistry.persample import _LayerClip
from dpregistry.privacy.secret import SecretStream
from dpregistry.stages import ClippedSum, Release
from dpreg_baseline.privatizers import GaussianPrivatizer
from dpreg_nonsmooth.privatizers import TreeAggregationPrivatizer

DELTA = 1e-5
VARIANTS = ("honest", "noise_halved", "sensitivity_c", "clip_skipped")


# ------------------------------------------------------------------------------------------------
# the neighbouring data sets, and the broken privatizers a recipe can name
# ------------------------------------------------------------------------------------------------


class CanaryParams(StageParams):
    n: int = Field(gt=1, description="records; the last one is the slot where D and D' differ")
    features: int = 8
    outputs: int = 4
    loss: Literal["squared", "linear"] = Field(
        default="squared", description="½‖Wx − y‖², or −yᵀWx (Lipschitz, for the nonsmooth oracles)")
    scale: float = Field(default=100.0, description="the slot's input x = scale·e_last: far beyond any clip")
    branches: int = Field(default=1, ge=1, description="W x summed over this many parallel layers (per-layer "
                                                      "clipping: the slot's gradient is split among them)")


class CanaryRegression(TorchObjective):
    """A linear model W (outputs × features, no bias, W₀ = 0) on two neighbouring data sets.

    Records 0..n−2 are random with x[last] = 0; the slot (record n−1) is x = scale·e_last with
    target +v in D and −v in D' (``holding(1)``). Every loss of Wx gives the other records a zero
    last column of ∇W, and the slot ±(v ⊗ x) at W = 0 (or anywhere, for the linear loss).
    """

    name = "audit_canary"
    Params = CanaryParams

    def build(self, ctx):
        p = self.cfg
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(p.n, p.features, generator=g)
        self.x[:, -1] = 0.0
        self.x[-1] = 0.0
        self.x[-1, -1] = p.scale
        self.y = torch.randn(p.n, p.outputs, generator=g)
        self.n_train = p.n
        layers = [nn.Linear(p.features, p.outputs, bias=False) for _ in range(p.branches)]
        for layer in layers:
            nn.init.zeros_(layer.weight)
        self.model = layers[0] if p.branches == 1 else Branches(layers)
        self.which = 0

    @contextmanager
    def holding(self, which: int):
        """Serve D (0) or D' (1), where the canary replaces the last record."""
        self.which, before = which, self.which
        try:
            yield
        finally:
            self.which = before

    def _targets(self, indices):
        y = self.y[indices]
        return torch.where((indices == self.n_train - 1).unsqueeze(1) & (self.which == 1), -y, y)

    def _loss(self, out, y):
        return 0.5 * (out - y).pow(2).sum(-1) if self.cfg.loss == "squared" else -(out * y).sum(-1)

    def batch_losses(self, indices):
        return self._loss(self.model(self.x[indices]), self._targets(indices))

    def functional_losses(self, params, indices):
        out = torch.func.functional_call(self.model, params, (self.x[indices],))
        return self._loss(out, self._targets(indices))


class Branches(nn.Module):
    """Σ_b W_b x: at W = 0 every branch gets the same gradient, so under per-layer clipping each
    carries C/√G of the slot's 2C and the clipped sums still differ by exactly 2C."""

    def __init__(self, layers):
        super().__init__()
        self.branches = nn.ModuleList(layers)

    def forward(self, x):
        return sum(layer(x) for layer in self.branches)


class GaussianSensitivityC(GaussianPrivatizer):
    """Broken: the clipped sum's sensitivity taken as C under replace-one (it is 2C)."""

    name = "audit_gaussian_sensitivity_c"

    def sensitivity(self):
        return self.cfg.clip


class TreeSensitivityC(TreeAggregationPrivatizer):
    """Broken: the stream elements' sensitivity taken as R/B under replace-one (it is 2R/B)."""

    name = "audit_tree_sensitivity_c"

    def sensitivities(self):
        s = super().sensitivities()
        return dict(s, fresh=s["fresh"] / 2, vr=s["vr"] / 2)


class Scaled(SecretStream):
    """A noise source that returns ``factor`` times the noise of another."""

    def __init__(self, inner: SecretStream, factor: float):
        self.inner, self.factor = inner, factor

    def randn(self, shape, dtype=torch.float32, device="cpu"):
        return self.inner.randn(shape, dtype=dtype, device=device).mul_(self.factor)


def _off_by_one(clip_weights):
    def weights(norms, clip, finite):
        w = clip_weights(norms, clip, finite)
        w[-1:] = finite[-1:].to(w.dtype)  # the last example keeps its norm
        return w
    return weights


@contextmanager
def layer_bound_c():
    """Broken per-layer clipping: every layer clipped to C instead of C/√G (G = 4 here: the slot's
    sums then differ by 2√G·C = 4C against the 2C the noise is calibrated to)."""
    init = _LayerClip.__init__

    def bound_c(self, sampler, uses, clip, finite):
        init(self, sampler, uses, clip, finite)
        self.clip = clip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_LayerClip, "__init__", bound_c)
        yield


@contextmanager
def last_example_unclipped():
    """Broken clipping: every clipped sum leaves its last example unclipped."""
    with pytest.MonkeyPatch.context() as mp:
        for module in (dpregistry.clipping, dpreg_nonsmooth.privatizers):
            mp.setattr(module, "clip_weights", _off_by_one(module.clip_weights))
        yield


# ------------------------------------------------------------------------------------------------
# the one place that drives a run's stages
# ------------------------------------------------------------------------------------------------


class Stages:
    """A prepared run's stages, driven as an auditor does: every release is the first of its step
    and period. (Stages will later see a narrower context than the Run; only this class changes.)"""

    def __init__(self, run):
        self.run = run
        self.objective = run.objective
        self._batches: list[torch.Tensor] = []

    def batches(self, count: int) -> list[torch.Tensor]:
        """The sampler's batches at steps 0..count−1, each drawn once (a deterministic sampler
        draws one batch: a single pass cannot read its records twice)."""
        sampler, run = self.run.sampler, self.run
        if not self.secret_sampling:
            count = 1
        self._batches += [sampler.indices(run.ctx.at(t)) for t in range(len(self._batches), count)]
        return self._batches[:count]

    @property
    def secret_sampling(self) -> bool:
        """Whether the batches are random (and secret): then every trial needs its own."""
        return self.run.sampler.amplifies

    def clipped_sum(self, indices: torch.Tensor) -> ClippedSum:
        run = self.run
        run.estimator.reset()
        total = run.privatize_batch(indices)
        run.ctx.undo_displacement()  # a zeroth-order estimator leaves x − λu for the update rule
        return total

    def release(self, total: ClippedSum) -> Release:
        self.run.privatizer.reset()
        return self.run.privatizer.release(total, self.run.begin_step())

    def claimed_epsilon(self, release: Release) -> float:
        """ε at δ of one release, from its own events through the run's sampler and accountant."""
        run = self.run
        charges = run.sampler.account(run.step, release.events, run.ctx)
        return run.accountant.epsilon(DELTA, extra=charges)

    @contextmanager
    def noise_scaled(self, factor: float):
        source = self.run.rng.noise
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(self.run.rng, "noise", lambda step, call: Scaled(source(step, call), factor))
            yield


# ------------------------------------------------------------------------------------------------
# the five mechanisms
# ------------------------------------------------------------------------------------------------


@dataclass
class Mechanism:
    recipe: dict
    space: str                     # where the privatizer clips and noises
    clip: float                    # the per-example bound C of the recipe
    weak_privatizer: str           # the same privatizer with the sensitivity taken as C
    trials: dict[str, int]         # per data set, per variant


def _recipe(**sections) -> dict:
    # Reproducible noise makes every audit deterministic; test_audit_with_secure_noise runs the default.
    return {"privacy": {"epsilon": 3.0, "delta": DELTA, "noise": "reproducible"},
            "train": {"steps": 1, "progress": False}, **sections}


MECHANISMS = {
    # DP-SGD: per-example gradients (hooks) of a small linear model, Poisson q = 0.1, amplified
    "dp_sgd": Mechanism(
        _recipe(algorithm="dp_sgd", objective={"name": "audit_canary", "n": 100},
                sampler={"name": "poisson", "batch_size": 10},
                privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"},
                accountant="pld", privacy={"epsilon": 2.0, "delta": DELTA}),
        space="dense", clip=1.0, weak_privatizer="audit_gaussian_sensitivity_c",
        trials={"honest": 100_000, "noise_halved": 100_000, "sensitivity_c": 100_000, "clip_skipped": 20_000}),
    # the same with per-layer clipping (opt-in): four parallel layers, each clipped to C/√4
    "dp_sgd_per_layer": Mechanism(
        _recipe(algorithm="dp_sgd", objective={"name": "audit_canary", "n": 100, "branches": 4},
                sampler={"name": "poisson", "batch_size": 10},
                privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto", "clipping": "per_layer"},
                accountant="pld", privacy={"epsilon": 2.0, "delta": DELTA}),
        space="dense", clip=1.0, weak_privatizer="audit_gaussian_sensitivity_c",
        trials={"honest": 100_000, "noise_halved": 100_000, "sensitivity_c": 100_000, "clip_skipped": 20_000,
                "layer_bound_c": 100_000}),
    # DPZero: one scalar per example (f₊ − f₋)/2λ on a public direction, one scalar of noise
    "dpzero": Mechanism(
        _recipe(algorithm="dpzero", objective={"name": "audit_canary", "n": 32},
                sampler={"name": "full_batch"},
                privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"}, accountant="pld"),
        space="seeded_direction", clip=1.0, weak_privatizer="audit_gaussian_sensitivity_c",
        trials={"honest": 400_000, "noise_halved": 400_000, "sensitivity_c": 400_000, "clip_skipped": 20_000}),
    # DP-GRAPE: per-example Pᵀ·G of the (projected) linear layer, clipped and noised in rank 2
    "dp_grape": Mechanism(
        _recipe(algorithm="dp_grape", objective={"name": "audit_canary", "n": 32},
                sampler={"name": "full_batch"}, estimator={"name": "projected_per_example_grad", "rank": 2},
                privatizer={"name": "gaussian", "clip": 1.0, "noise_multiplier": "auto"}, accountant="pld"),
        space="projected", clip=1.0, weak_privatizer="audit_gaussian_sensitivity_c",
        trials={"honest": 400_000, "noise_halved": 400_000, "sensitivity_c": 400_000, "clip_skipped": 20_000}),
    # one node of the tree mechanism: a period of one step (the leaf's only node), first-order
    # oracle clipped at its public bound R = L, single pass
    "tree_node": Mechanism(
        _recipe(algorithm={"name": "ztc_o2nc_tree", "episode_len": 1},
                objective={"name": "audit_canary", "n": 8, "features": 4, "outputs": 2, "loss": "linear"},
                sampler={"name": "single_pass", "batch_first": 8, "batch_rest": 1, "order": "sequential"},
                estimator={"name": "fo_ball", "smooth_radius": 0.05, "lipschitz": 1.0, "privacy_mode": "clip"},
                privatizer={"name": "tree_aggregation", "noise_multiplier": "auto"},
                update={"name": "o2nc"}, accountant="pld"),
        space="dense", clip=1.0, weak_privatizer="audit_tree_sensitivity_c",
        trials={"honest": 400_000, "noise_halved": 400_000, "sensitivity_c": 400_000, "clip_skipped": 20_000}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name, broken) -> the Stages of mechanism ``name``'s run, prepared once: the recipe's, or
    (``broken``) with the privatizer that takes the sensitivity as C, and another seed."""
    from dpregistry.registry import Registry

    registry = Registry().load_entry_points()
    registry.add_plugin(StagePlugin(CanaryRegression, GaussianSensitivityC, TreeSensitivityC),
                        origin="tests (privacy audit)")
    cache: dict[tuple[str, bool, str], Stages] = {}

    def get(name: str, broken: bool, noise: str = "reproducible") -> Stages:
        if (name, broken, noise) not in cache:
            mech = MECHANISMS[name]
            recipe = {**mech.recipe, "seed": int(broken)}
            recipe["privacy"] = {**recipe["privacy"], "noise": noise}
            if broken:
                recipe["privatizer"] = {**recipe["privatizer"], "name": mech.weak_privatizer}
            cache[name, broken, noise] = Stages(make_run(recipe, tmp_path_factory.mktemp(name), registry=registry))
        return cache[name, broken, noise]

    return get


# ------------------------------------------------------------------------------------------------
# trials
# ------------------------------------------------------------------------------------------------


def _trials(stages: Stages, n: int, clipping) -> tuple[ClippedSum, ClippedSum]:
    """(the clipped sums of n trials on D and then n on D', stacked; their noiseless difference in
    the slot). ``clipping`` is the context the canary's slot is clipped in."""
    obj = stages.objective
    slot = obj.n_train - 1
    if not stages.secret_sampling:  # a deterministic batch: every trial clips the same sum
        parts = []
        for which in (0, 1):
            with obj.holding(which), clipping():
                parts.append(stages.clipped_sum(stages.batches(1)[0]))
        masks = torch.zeros(2 * n, 2)
        masks[:n, 0] = masks[n:, 1] = 1
        return trial_sums(parts, masks), _difference(parts)
    # Poisson: each record clipped on its own; a trial adds up the records of its secret batch
    parts = [stages.clipped_sum(torch.tensor([i])) for i in range(slot)]
    for which in (0, 1):
        with obj.holding(which), clipping():
            parts.append(stages.clipped_sum(torch.tensor([slot])))
    batches = stages.batches(2 * n)
    masks = torch.zeros(2 * n, slot + 2)
    rows = torch.repeat_interleave(torch.arange(2 * n), torch.tensor([len(b) for b in batches]))
    masks[rows, torch.cat(batches)] = 1
    masks[n:, slot + 1] = masks[n:, slot]  # D' trials add the canary's slot instead
    masks[n:, slot] = 0
    total = trial_sums(parts, masks)
    _check_against_the_engine(stages, batches, masks, total, n, clipping)
    return total, _difference(parts[slot:])


def _difference(pair: list[ClippedSum]):
    d = pair[1].aggregate.clone()
    for k, t in d.tensors.items():
        t.sub_(pair[0].aggregate.tensors[k])
    return d


def _check_against_the_engine(stages, batches, masks, total, n, clipping, checks=4):
    """A stacked trial equals the engine's clipped sum of its batch (with the canary's slot last)."""
    slot = stages.objective.n_train - 1
    for which in (0, 1):
        held = masks[which * n:(which + 1) * n, slot + which].nonzero().squeeze(1)[:checks] + which * n
        assert len(held) == checks
        for t in held.tolist():
            with stages.objective.holding(which), clipping():
                engine = stages.clipped_sum(batches[t]).aggregate.tensors
            for k, v in engine.items():
                assert torch.allclose(total.aggregate.tensors[k][t], v, rtol=1e-5, atol=1e-6)


def run_audit(stages: Stages, mech: Mechanism, variant: str):
    """(the ε claimed for one release, the audit's lower bound on it, the release's space, and the
    distance of the noiseless clipped sums on D and D')."""
    n = mech.trials[variant]
    clipping = last_example_unclipped if variant == "clip_skipped" else nullcontext
    total, direction = _trials(stages, n, clipping)
    with stages.noise_scaled(0.5) if variant == "noise_halved" else nullcontext():
        release = stages.release(total)  # all 2n trials in one call of the privatizer's release
    stats = projections(release.value, direction)
    claimed = stages.claimed_epsilon(release)  # of one release: the events are per trial
    result = epsilon_lower_bound(stats[:n], stats[n:], DELTA)
    gap = float(torch.cat([v.reshape(-1) for v in direction.tensors.values()]).norm())
    return claimed, result.epsilon_lower, release.value.space, gap


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(MECHANISMS))
def test_audit(name, variant, runs):
    mech = MECHANISMS[name]
    t0 = time.perf_counter()
    claimed, audited, space, gap = run_audit(runs(name, variant == "sensitivity_c"), mech, variant)
    print(f"\n{name} {variant}: claimed ε = {claimed:.3f}, audited ε >= {audited:.3f} "
          f"({mech.trials[variant]} trials on each data set, {time.perf_counter() - t0:.1f} s)")
    assert space == mech.space
    assert claimed <= mech.recipe["privacy"]["epsilon"] * (1 + 1e-9)  # what the run's budget admitted
    if variant == "honest":
        assert gap == pytest.approx(2 * mech.clip, rel=1e-5)  # the canary attains the sensitivity 2C
        assert audited <= claimed
        assert audited > 0.25 * claimed  # and the audit sees it
    else:
        assert audited > claimed
    if variant == "clip_skipped":
        assert gap > 2 * mech.clip  # the canary's clip was skipped: the sums differ by more than 2C


def test_audit_catches_a_per_layer_bound_of_c(runs):
    """Per-layer clipping's own way to break: each of the G layers bounded by C, not C/√G."""
    mech = MECHANISMS["dp_sgd_per_layer"]
    with layer_bound_c():  # every record's clipping, as a broken implementation would do it
        claimed, audited, _, gap = run_audit(runs("dp_sgd_per_layer", False), mech, "layer_bound_c")
    print(f"\ndp_sgd_per_layer layer_bound_c: claimed ε = {claimed:.3f}, audited ε >= {audited:.3f}")
    assert gap == pytest.approx(2 * mech.clip * 4 ** 0.5, rel=1e-5)
    assert audited > claimed


@pytest.mark.parametrize("variant", ["honest", "noise_halved"])
def test_audit_with_secure_noise(variant, runs):
    """The default mode's cipher Gaussians, through the same audit: not deterministic, but the
    honest bound sits 4-6 standard deviations below the claim and the halved noise as far above it."""
    mech = MECHANISMS["dpzero"]
    stages = runs("dpzero", False, "secure")
    assert stages.run.rng.noise_mode == "secure"
    claimed, audited, _, _ = run_audit(stages, mech, variant)
    assert (audited <= claimed) if variant == "honest" else (audited > claimed)
