"""Gaussian privatizers whose noise the algorithm's schedule sets per call.

The KL algorithms compute every σ from their schedules (or, for adaptive noisy GD, from an earlier
noisy release), so the privatizer takes ``std`` on every ``release`` (the std of the noise on the
clipped *sum*; the release is then divided by n). Each release reports
``Gaussian(std, sensitivity)`` with the true sensitivity of the clipped sum under the run's
relation (2C for replace-one), so the accountant charges Δ²/(2σ²) of the σ actually used.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from dpregistry import Privatizer, Release, StageParams
from dpregistry.clipping import clip_and_sum
from dpregistry.privacy.events import Gaussian, clipped_sum_sensitivity
from dpregistry.spaces import GRADIENT, INCREMENT, DenseAggregate

from .common import declared, user_error


class ScheduledParams(StageParams):
    clip: float | Literal["auto"] = Field(
        default="auto", description="per-example L2 bound L0 (auto: the objective's declared Lipschitz constant)")


class ScheduledGaussian(Privatizer):
    """Clip each example to L0, sum, add N(0, std²) with the std the algorithm sets per call, ÷ n."""

    name = "scheduled_gaussian"
    Params = ScheduledParams

    def setup(self, run):
        self.relation = run.relation
        self.clip = declared(run, "lipschitz", "privatizer.clip") if self.cfg.clip == "auto" else float(self.cfg.clip)

    def validate(self, run):
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise user_error(run, "clip must be positive and finite: it bounds the sensitivity", "privatizer.clip")

    def sensitivity(self, clip: float | None = None) -> float:
        """L2 distance between neighbouring clipped sums (2C replace-one, C add/remove)."""
        return clipped_sum_sensitivity(self.clip if clip is None else clip, self.relation)

    def event(self, std: float, clip: float | None = None) -> Gaussian:
        return Gaussian(std=std, sensitivity=self.sensitivity(clip))

    def planned_events(self, noise_multiplier, run):
        return [self.event(noise_multiplier * self.clip)]

    def clip_sum(self, contribution):
        return clip_and_sum(contribution, self.clip)

    def _noise(self, total, run, std):
        if std is None or not (std > 0 and math.isfinite(std)):
            raise RuntimeError(f"{self.name} releases only with a positive std set by the algorithm, got {std!r}")
        agg = total.aggregate
        agg.add_noise_(std, run.noise())
        n = run.sampler.expected_batch_size(run)
        agg.mul_(1.0 / n)
        return agg, n

    def release(self, total, run, *, std=None):
        agg, n = self._noise(total, run, std)
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
    """

    name = "spider_gaussian"
    accepts_kinds = frozenset({GRADIENT, INCREMENT})
    Params = SpiderGaussianParams

    def setup(self, run):
        super().setup(run)
        self.smoothness = (declared(run, "smoothness", "privatizer.smoothness") if self.cfg.smoothness == "auto"
                           else float(self.cfg.smoothness))
        self.v: dict[str, torch.Tensor] | None = None
        self._pending: float | None = None

    def validate(self, run):
        super().validate(run)
        if not (self.smoothness > 0 and math.isfinite(self.smoothness)):
            raise user_error(run, "smoothness must be positive and finite", "privatizer.smoothness")

    def increment_clip(self, step_bound: float) -> float:
        return self.smoothness * step_bound

    def reset(self):
        self.v = None

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

    def release(self, total, run, *, std=None):
        clip, self._pending = self._pending, None
        if clip is None:
            raise RuntimeError("release without a clipped sum")
        agg, n = self._noise(total, run, std)
        if total.kind == INCREMENT:
            if self.v is None:
                raise RuntimeError("an increment before any anchor: reset() starts a round with an anchor")
            for k, t in agg.tensors.items():
                self.v[k].add_(t)
        else:
            self.v = {k: t.clone() for k, t in agg.tensors.items()}
        value = DenseAggregate({k: t.clone() for k, t in self.v.items()})
        return Release(value, [self.event(std, clip)], kind=GRADIENT, stats={"noise_std": std / n})

    def state_dict(self):
        return {"v": dict(self.v) if self.v is not None else None}

    def load_state_dict(self, state):
        v = state.get("v")
        self.v = {k: t.clone() for k, t in v.items()} if v else None


PRIVATIZERS = (ScheduledGaussian, SpiderGaussian)
