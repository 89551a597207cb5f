"""Update rules: SGD and Adam (dense; they lift other spaces), and memory-free directional SGD."""

from __future__ import annotations

import math

import torch
from pydantic import Field

from dpregistry import StageParams, UpdateRule
from dpregistry.spaces import DENSE, PROJECTED, SEEDED_DIRECTION, acc_dtype


class SGDParams(StageParams):
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)


class SGD(UpdateRule):
    """x ← x − lr·(ĝ + wd·x), with optional heavy-ball momentum. Lifts any space to dense."""

    name = "sgd"
    accepts = frozenset({DENSE})
    lifts = frozenset({SEEDED_DIRECTION, PROJECTED})
    Params = SGDParams

    def setup(self, run):
        self.buf: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def apply(self, params, release, run):
        run.undo_displacement()
        grads = release.value.lift(params)
        p = self.cfg
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if p.weight_decay:
                g = g + p.weight_decay * x.to(g.dtype)
            if p.momentum:
                b = self.buf.get(k)
                b = g.clone() if b is None else b.mul_(p.momentum).add_(g)
                self.buf[k] = b
                g = b
            x.sub_((p.lr * g).to(x.dtype))

    def state_dict(self):
        return {"buf": dict(self.buf)}

    def load_state_dict(self, state):
        self.buf = dict(state.get("buf", {}))


class AdamParams(StageParams):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, description="decoupled (AdamW)")


class Adam(UpdateRule):
    """Adam in the form of DP-GRAPE Alg. 3: α_t = lr·√(1−β2^t)/(1−β1^t), x ← x − α_t·m/(√v + eps).

    (eps sits on √v without bias correction; it equals torch's eps·√(1−β2^t).) Lifts any space.
    """

    name = "adam"
    accepts = frozenset({DENSE})
    lifts = frozenset({SEEDED_DIRECTION, PROJECTED})
    Params = AdamParams

    def setup(self, run):
        self.t = 0
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def apply(self, params, release, run):
        run.undo_displacement()
        grads = release.value.lift(params)
        b1, b2 = self.cfg.betas
        self.t += 1
        alpha = self.cfg.lr * math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if k not in self.m:
                self.m[k] = torch.zeros_like(g)
                self.v[k] = torch.zeros_like(g)
            m, v = self.m[k], self.v[k]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            step = m / (v.sqrt() + self.cfg.eps)
            if self.cfg.weight_decay:
                x.mul_(1 - self.cfg.lr * self.cfg.weight_decay)
            x.sub_((alpha * step).to(x.dtype))

    def state_dict(self):
        return {"t": self.t, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state):
        self.t = int(state.get("t", 0))
        self.m = dict(state.get("m", {}))
        self.v = dict(state.get("v", {}))


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
    def apply(self, params, release, run):
        agg = release.value
        tensors = [params[n] for n in agg.names]
        scale = -self.cfg.lr * agg.coeff
        d = run.take_displacement()
        if d is not None and d.direction == agg.direction and d.names == agg.names:
            scale -= d.scale  # restore x from x + d.scale·u in the same sweep
        elif d is not None:
            d.direction.add_([params[n] for n in d.names], -d.scale)
        agg.direction.add_(tensors, scale)


UPDATE_RULES = (SGD, Adam, DirectionalSGD)
