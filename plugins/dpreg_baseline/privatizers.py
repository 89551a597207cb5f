"""The generic clip-and-noise privatizer, in every space, and the non-private identity."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from dpregistry import NoiseStd, Privatizer, Release, StageParams, UserError
from dpregistry.clipping import clip_and_sum, clip_and_sum_per_layer
from dpregistry.persample import LayerGradients
from dpregistry.privacy.events import Gaussian, NonPrivate, clipped_sum_sensitivity


class GaussianParams(StageParams):
    clip: float = Field(gt=0, allow_inf_nan=True,
                        description="per-example L2 bound C, in the estimator's space (inf: no clipping)")
    noise_multiplier: float | Literal["auto"] = Field(
        default="auto", description="std of the noise on the clipped sum ÷ C; auto: calibrated to the budget")
    clipping: Literal["flat", "per_layer"] = Field(
        default="flat", description="flat: each example's whole gradient to C; per_layer (opt-in, hook estimators): "
                                    "each layer's to C/√(layers), summed as the backward goes (about the memory of "
                                    "a non-private backward; the same sensitivity C and noise; another utility)")


class GaussianPrivatizer(Privatizer):
    """Clip each example to norm C in its space, sum, add N(0, (zC)²) per coordinate, divide by E[B].

    ``clipping: per_layer`` (opt-in, hook estimators) clips each layer's part to C/√G instead, inside
    the backward; the sum's sensitivity is still C (``dpregistry.persample._LayerClip``).

    In the seeded-direction space (DPZero) the contribution is one scalar per example, so this is
    DPZero's scalar clip with one scalar noise draw; in the dense space it is DP-SGD's.
    """

    name = "gaussian"
    user_level = True  # clip_and_sum clips a user's rows as one
    Params = GaussianParams
    provides = (NoiseStd,)  # every release states noise_std

    def __init__(self, params=None):
        super().__init__(params)
        if self.cfg.clipping == "per_layer":  # contributions clipped per layer: a hook estimator's
            self.needs = (LayerGradients,)

    def setup(self, ctx):
        self.relation = ctx.relation
        z = self.cfg.noise_multiplier
        self.noise_multiplier = None if self.calibrates else float(z)

    @property
    def calibrates(self):
        return self.cfg.noise_multiplier == "auto"

    def provide(self, kind):
        return NoiseStd()

    def validate(self, ctx):
        if not math.isfinite(self.cfg.clip):
            if self.calibrates or self.noise_multiplier:
                raise UserError("clip: inf makes the sensitivity unbounded, so no noise can make it private; "
                                "set a finite clip, or noise_multiplier: 0 for a non-private run",
                                key="privatizer.clip")
        elif self.noise_multiplier is not None and self.noise_multiplier < 0:
            raise UserError("noise_multiplier must be >= 0", key="privatizer.noise_multiplier")
        if self.cfg.clipping == "per_layer":
            if ctx.clips_groups:
                raise UserError("clipping: per_layer cannot clip a user's examples as one (user-level sampling, "
                                "user_poisson); use clipping: flat", key="privatizer.clipping")
            ctx.need(LayerGradients)  # the estimator refuses settings that cannot clip per layer

    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum under the run's relation (2C replace-one, C add/remove)."""
        return clipped_sum_sensitivity(self.cfg.clip, self.relation)

    def clip_sum(self, contribution):
        if self.cfg.clipping == "per_layer":
            return clip_and_sum_per_layer(contribution, self.cfg.clip)
        return clip_and_sum(contribution, self.cfg.clip)

    def _events(self, std: float):
        if std == 0 or not math.isfinite(self.cfg.clip):
            return [NonPrivate()]
        return [Gaussian(std=std, sensitivity=self.sensitivity())]

    def planned_events(self, noise_multiplier, ctx):
        return self._events(noise_multiplier * self.cfg.clip if math.isfinite(self.cfg.clip) else 0.0)

    def release(self, total, ctx, *, std=None):
        if std is None:
            std = self.noise_multiplier * self.cfg.clip if math.isfinite(self.cfg.clip) else 0.0
        agg = total.aggregate
        agg.add_noise_(std, ctx.noise())
        denom = ctx.expected_batch_size()
        agg.mul_(1.0 / denom)
        return Release(agg, self._events(std), kind=total.kind,
                       stats={"noise_std": std / denom})


class NoPrivatizer(Privatizer):
    """No clipping and no noise: non-private training (MeZO, SGD); ε is reported as infinite."""

    name = "none"
    user_level = True  # clip_and_sum clips a user's rows as one

    def setup(self, ctx):
        self.noise_multiplier = 0.0

    def clip_sum(self, contribution):
        return clip_and_sum(contribution, math.inf)

    def planned_events(self, noise_multiplier, ctx):
        return [NonPrivate()]

    def release(self, total, ctx, *, std=None):
        agg = total.aggregate
        agg.mul_(1.0 / max(total.count, 1))
        return Release(agg, [NonPrivate()], kind=total.kind)


PRIVATIZERS = (GaussianPrivatizer, NoPrivatizer)
