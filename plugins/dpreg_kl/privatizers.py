"""Gaussian privatizers whose noise the algorithm's schedule sets per call.

The KL algorithms compute every σ from their schedules (or, for adaptive noisy GD, from an earlier
noisy release), so the privatizer takes ``std`` on every ``release`` (the std of the noise on the
clipped *sum*; the release is then divided by n). Each release reports
``Gaussian(std, sensitivity)`` with the true sensitivity of the clipped sum under the run's
relation (2C for replace-one), so the accountant charges Δ²/(2σ²) of the σ actually used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from dpregistry import NoiseStd, Objective, Privatizer, Release, StageParams, UserError
from dpregistry.clipping import clip_and_sum
from dpregistry.privacy.events import Gaussian, clipped_sum_sensitivity
from dpregistry.spaces import GRADIENT, INCREMENT, DenseAggregate

from .common import declared


class ScheduledParams(StageParams):
    clip: float | Literal["auto"] = Field(
        default="auto", description="per-example L2 bound L0 (auto: the objective's declared Lipschitz constant)")


class ScheduledGaussian(Privatizer):
    """Clip each example to L0, sum, add N(0, std²) with the std the algorithm sets per call, ÷ n."""

    name = "scheduled_gaussian"
    user_level = True  # clip_and_sum clips a user's rows as one
    Params = ScheduledParams
    needs = (Objective,)  # for ``auto``: its declared constants (KLConstants)
    provides = (NoiseStd,)  # each release states the std of the noise on its value, std/n

    def provide(self, kind):
        return NoiseStd()

    def setup(self, ctx):
        self.relation = ctx.relation
        self.clip = (declared(ctx.need(Objective), "lipschitz", "privatizer.clip") if self.cfg.clip == "auto"
                     else float(self.cfg.clip))

    def validate(self, ctx):
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise UserError("clip must be positive and finite: it bounds the sensitivity", key="privatizer.clip")

    def sensitivity(self, clip: float | None = None) -> float:
        """L2 distance between neighbouring clipped sums (2C replace-one, C add/remove)."""
        return clipped_sum_sensitivity(self.clip if clip is None else clip, self.relation)

    def event(self, std: float, clip: float | None = None) -> Gaussian:
        return Gaussian(std=std, sensitivity=self.sensitivity(clip))

    def planned_events(self, noise_multiplier, ctx):
        if noise_multiplier is None:  # a generic algorithm's plan: it would release without a std
            raise UserError(f"privatizer {self.name} takes its noise from the algorithm at each release (the KL "
                            f"algorithms' schedules), and this algorithm sets none: use it with a KL algorithm, "
                            f"or privatizer gaussian", key="privatizer.name")
        return [self.event(noise_multiplier * self.clip)]

    def clip_sum(self, contribution):
        return clip_and_sum(contribution, self.clip)

    def _noise(self, total, ctx, std):
        if std is None or not (std > 0 and math.isfinite(std)):
            raise RuntimeError(f"{self.name} releases only with a positive std set by the algorithm, got {std!r}")
        agg = total.aggregate
        agg.add_noise_(std, ctx.noise())
        n = ctx.expected_batch_size()
        agg.mul_(1.0 / n)
        return agg, n

    def release(self, total, ctx, *, std=None):
        agg, n = self._noise(total, ctx, std)
        return Release(agg, [self.event(std)], kind=total.kind, stats={"noise_std": std / n})


class SpiderGaussianParams(ScheduledParams):
    smoothness: float | Literal["auto"] = Field(
        default="auto", description="per-sample smoothness L1: a difference over a step of length r is clipped to L1·r")


class SpiderGaussian(ScheduledGaussian):
    """SPIDER's privatizer: noise on the anchor and on each gradient difference, never on the sum.

    An anchor (GRADIENT) is clipped to L0 per example; a difference (INCREMENT) over a step of
    length ≤ r to L1·r, so its sensitivity is 2L1·r/n whatever the loss (spec §1.1 [REC]). The
    release is the running noisy estimate v = anchor + Σ increments, reset at each anchor; v is
    post-processing of the noisy queries, so the round-end test on ‖v‖ is free, and
    v − ∇F(w) is exactly the sum of the noise added since the anchor (Lemma 2's telescoping).
    A release's ``noise_std`` is that of the noise it added, not of the noise on v, which sums the
    round's: so it does not provide ``NoiseStd``.
    """

    provides = ()

    name = "spider_gaussian"
    accepts_kinds = frozenset({GRADIENT, INCREMENT})
    Params = SpiderGaussianParams

    @dataclass
    class State:
        v: dict[str, torch.Tensor] | None = None  # the running estimate (None until a round's anchor)

    def setup(self, ctx):
        super().setup(ctx)
        self.smoothness = (declared(ctx.need(Objective), "smoothness", "privatizer.smoothness")
                           if self.cfg.smoothness == "auto" else float(self.cfg.smoothness))
        self._pending: float | None = None  # the clip of the sum about to be released (within a step)

    def validate(self, ctx):
        super().validate(ctx)
        if not (self.smoothness > 0 and math.isfinite(self.smoothness)):
            raise UserError("smoothness must be positive and finite", key="privatizer.smoothness")

    def increment_clip(self, step_bound: float) -> float:
        return self.smoothness * step_bound

    def reset(self):
        self.state.v = None

    def clip_sum(self, contribution):
        if contribution.kind == INCREMENT:
            if "step_bound" not in contribution.info:
                raise RuntimeError("an increment needs info['step_bound'] (the bound on the step it spans)")
            clip = self.increment_clip(contribution.info["step_bound"])
        else:
            clip = self.clip
        if not (clip > 0 and math.isfinite(clip)):
            raise RuntimeError(f"invalid clip {clip!r}")
        self._pending = clip
        return clip_and_sum(contribution, clip)

    def release(self, total, ctx, *, std=None):
        clip, self._pending = self._pending, None
        if clip is None:
            raise RuntimeError("release without a clipped sum")
        agg, n = self._noise(total, ctx, std)
        s = self.state
        if total.kind == INCREMENT:
            if s.v is None:
                raise RuntimeError("an increment before any anchor: reset() starts a round with an anchor")
            for k, t in agg.tensors.items():
                s.v[k].add_(t)
        else:
            s.v = {k: t.clone() for k, t in agg.tensors.items()}
        value = DenseAggregate({k: t.clone() for k, t in s.v.items()})
        return Release(value, [self.event(std, clip)], kind=GRADIENT, stats={"noise_std": std / n})


PRIVATIZERS = (ScheduledGaussian, SpiderGaussian)
