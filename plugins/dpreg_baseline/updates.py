"""Update rules: SGD and Adam (dense; they lift other spaces), and memory-free directional SGD."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field, field_validator, model_validator

from dpregistry import NoiseStd, StageParams, UpdateRule, UserError
from dpregistry.averaging import AverageState, AveragesIterates, AveragingParams
from dpregistry.moments import step_size, sub_ratio_, update_moments_
from dpregistry.spaces import DENSE, PROJECTED, SEEDED_DIRECTION, acc_dtype


class SGDParams(AveragingParams):
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)


class SGD(AveragesIterates, UpdateRule):
    """x ← x − lr·(ĝ + wd·x), with optional heavy-ball momentum. Lifts any space to dense.
    ``average``: :mod:`dpregistry.averaging`."""

    name = "sgd"
    accepts = frozenset({DENSE})
    lifts = frozenset({SEEDED_DIRECTION, PROJECTED})
    Params = SGDParams

    @dataclass
    class State(AverageState):
        buf: dict[str, torch.Tensor] = field(default_factory=dict)  # momentum, by parameter

    @torch.no_grad()
    def apply(self, params, release, ctx):
        ctx.undo_displacement()
        grads = release.value.lift(params)
        p = self.cfg
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if p.weight_decay:
                g = g + p.weight_decay * x.to(g.dtype)
            if p.momentum:
                b = self.state.buf.get(k)
                b = g.clone() if b is None else b.mul_(p.momentum).add_(g)
                self.state.buf[k] = b
                g = b
            x.sub_((p.lr * g).to(x.dtype))
        self._average_(params)


class AdamParams(AveragingParams):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, description="decoupled (AdamW)")
    lr_scale: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="{regex: factor}: a parameter whose name matches takes lr × factor (the "
                                          "first match; post-processing, so the privacy is unchanged)")

    @field_validator("lr_scale")
    @classmethod
    def _patterns_compile(cls, v):
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression: {e}") from None
        return v

    noise_correction: bool = Field(
        default=False, description="DP-AdamBC: subtract the privacy noise's variance Φ = noise_std² from Adam's "
                                   "second moment (post-processing; the privacy is unchanged)")
    variance_floor: float | None = Field(
        default=None, gt=0, description="γ' of DP-AdamBC (default 1e-8): the corrected second moment is floored "
                                        "here, so √γ' is the smallest denominator; it takes eps's place (eps is "
                                        "unused with noise_correction)")

    @model_validator(mode="after")
    def _floor_needs_the_correction(self):
        if self.variance_floor is not None and not self.noise_correction:
            raise ValueError("variance_floor applies only with noise_correction: true")
        return self

    @property
    def floor(self) -> float:
        return 1e-8 if self.variance_floor is None else self.variance_floor

    def lr_of(self, name: str) -> float:
        return self.lr * next((f for pattern, f in self.lr_scale.items() if re.search(pattern, name)), 1.0)


class Adam(AveragesIterates, UpdateRule):
    """Adam in the form of DP-GRAPE Alg. 3: α_t = lr·√(1−β2^t)/(1−β1^t), x ← x − α_t·m/(√v + eps).

    (eps sits on √v without bias correction; it equals torch's eps·√(1−β2^t).) Lifts any space.

    ``noise_correction``: DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024, arXiv 2312.14334).
    The released mean gradient carries Gaussian noise of variance Φ = noise_std² per coordinate
    (σC/B), so v̂ = v/(1−β2^t) estimates E[g]² + Var(g) + Φ; once Φ dominates, √v̂ is a constant and
    Adam is SGD at another learning rate. The step becomes x ← x − lr/(1−β1^t)·m/√max(v̂ − Φ̄, γ')
    with γ' = ``variance_floor`` (1e-8) in place of eps, and Φ̄ the same moving average of the releases'
    Φ as v's (Φ itself when the noise is constant). Φ is read from each release's
    ``stats["noise_std"]``: only the privatizer knows it.

    ``average``: :mod:`dpregistry.averaging`.
    """

    name = "adam"
    accepts = frozenset({DENSE})
    lifts = frozenset({SEEDED_DIRECTION, PROJECTED})
    Params = AdamParams

    @dataclass
    class State(AverageState):
        t: int = 0
        m: dict[str, torch.Tensor] = field(default_factory=dict)  # first moments, by parameter
        v: dict[str, torch.Tensor] = field(default_factory=dict)  # second moments
        noise_var: float = 0.0  # v's moving average of the noise variance Φ (noise_correction)

    def __init__(self, params=None):
        super().__init__(params)
        if self.cfg.noise_correction:  # refused before step 1 where the privatizer states no noise
            self.needs = (NoiseStd,)

    def validate(self, ctx):
        for pattern in self.cfg.lr_scale:  # a typo would silently leave its parameters at lr
            if not any(re.search(pattern, name) for name in ctx.params):
                raise UserError(f"{pattern!r} matches no trainable parameter", key="update.lr_scale")

    @torch.no_grad()
    def apply(self, params, release, ctx):
        ctx.undo_displacement()
        phi = self._noise_variance(release) if self.cfg.noise_correction else None  # refused before any change
        grads = release.value.lift(params)
        s = self.state
        s.t += 1
        b1, b2 = self.cfg.betas
        noise = None
        if phi is not None:
            s.noise_var = b2 * s.noise_var + (1 - b2) * phi
            v_scale = 1 - b2 ** s.t
            noise = (v_scale, s.noise_var / v_scale, self.cfg.floor)
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if k not in s.m:
                s.m[k] = torch.zeros_like(g)
                s.v[k] = torch.zeros_like(g)
            update_moments_(s.m[k], s.v[k], g, self.cfg.betas)
            lr = self.cfg.lr_of(k)
            if self.cfg.weight_decay:
                x.mul_(1 - lr * self.cfg.weight_decay)
            if noise is None:
                sub_ratio_(x, s.m[k], s.v[k], self.cfg.eps, step_size(lr, self.cfg.betas, s.t))
            else:
                sub_ratio_(x, s.m[k], s.v[k], 0.0, lr / (1 - b1 ** s.t), noise)
        self._average_(params)

    @staticmethod
    def _noise_variance(release) -> float:
        """Φ = noise_std², the variance of the noise on each coordinate of the released mean."""
        std = release.stats.get("noise_std")
        if std is None:  # a privatizer that provides NoiseStd broke its word
            raise RuntimeError("noise_correction: the release states no noise_std")
        return float(std) ** 2


class DirectionalSGDParams(StageParams):
    lr: float = Field(gt=0)


class DirectionalSGD(UpdateRule):
    """x ← x − lr·ĝ·u(seed): regenerates u in place, fused with the estimator's restore sweep.

    Memory-free: no gradient, no optimizer state, no copy of the parameters.
    """

    name = "directional_sgd"
    accepts = frozenset({SEEDED_DIRECTION})
    Params = DirectionalSGDParams

    @torch.no_grad()
    def apply(self, params, release, ctx):
        agg = release.value
        tensors = [params[n] for n in agg.names]
        scale = -self.cfg.lr * agg.coeff
        d = ctx.take_displacement()
        if d is not None and d.direction == agg.direction and d.names == agg.names:
            scale -= d.scale  # restore x from x + d.scale·u in the same sweep
        elif d is not None:
            d.direction.add_([params[n] for n in d.names], -d.scale)
        agg.direction.add_(tensors, scale)


UPDATE_RULES = (SGD, Adam, DirectionalSGD)
