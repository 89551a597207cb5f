"""Update rules of the KL algorithms: normalised steps of a fixed length, and Alg. 4's projected GD."""

from __future__ import annotations

import math

import torch

from dpregistry import StageParams, UpdateRule
from dpregistry.spaces import DENSE


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


class NormalizedStep(UpdateRule):
    """w ← w − r·v/‖v‖: a step of length exactly r (KL-Spider, η_{k,t} = r_k/‖v‖).

    The controller sets r per step (``set_length``). The rule guarantees ‖w_new − w‖ ≤ r in
    floating point (it shrinks the step by a few ulps if rounding overshoots) and exposes
    ``step_bound = r``: the SPIDER difference query clips each per-sample difference to L1·r, so
    its sensitivity is data-independent (spec §4, coupling 3).
    """

    name = "normalized_step"
    accepts = frozenset({DENSE})
    Params = StageParams

    def setup(self, run):
        self.length: float | None = None
        self.step_bound: float | None = None

    def set_length(self, r: float) -> None:
        if not (r > 0 and math.isfinite(r)):
            raise ValueError(f"step length must be positive and finite, got {r!r}")
        self.length = float(r)

    @torch.no_grad()
    def apply(self, params, release, run):
        if self.length is None:
            raise RuntimeError("normalized_step needs its length from the controller (set_length)")
        r = self.length
        v = release.value.lift(params)
        vn = _norm(v.values())
        if not (vn > 0 and math.isfinite(vn)):
            raise RuntimeError(f"cannot normalise a direction of norm {vn!r}")
        scale = r / vn
        for attempt in range(64):
            new = {k: params[k] - (scale * v[k]).to(params[k].dtype) for k in params}
            moved = _norm(new[k] - params[k] for k in params)
            if moved <= r:
                break
            # rounding w_new to the grid around w can overshoot by ~‖w‖·2⁻⁵³: shrink by the overshoot
            # and a margin that doubles until the step fits
            scale *= min(r / moved, 1.0) * (1.0 - 2.0 ** (attempt - 52))
        else:  # pragma: no cover
            raise RuntimeError("could not keep the step within its length")
        for k in params:
            params[k].copy_(new[k])
        self.step_bound = r

    def state_dict(self):
        # the next difference query's clip depends on the last step's bound: resume needs it
        return {"length": self.length, "step_bound": self.step_bound}

    def load_state_dict(self, state):
        self.length = state.get("length")
        self.step_bound = state.get("step_bound")


class ProxProjectedGD(UpdateRule):
    """Alg. 4: u ← Π_{B_R(c)}(u − η_j(ĝ + 2L̃1(u − c))), η_j = 1/(L̃1 j), and the average Σ j·u_j.

    The regulariser's gradient 2L̃1(u − c) is data-independent and added after the noise, outside
    the clipping (spec §1.2 [REC]). ``begin`` starts a proximal call at the centre c = u_1;
    ``average`` returns ū = 2/(T_A(T_A+1)) Σ_{j=1}^{T_A} j·u_j. The projection keeps the iterates in
    B_R(c), which holds the minimiser of F + L̃1‖w − c‖² when R = L0/(2L̃1).
    """

    name = "prox_projected_gd"
    accepts = frozenset({DENSE})
    Params = StageParams

    def setup(self, run):
        self.centre: dict[str, torch.Tensor] | None = None
        self.acc: dict[str, torch.Tensor] | None = None
        self.j = 0
        self.prox = 0.0
        self.radius = 0.0

    @torch.no_grad()
    def begin(self, params, prox: float, radius: float) -> None:
        self.centre = {k: v.detach().clone() for k, v in params.items()}
        self.acc = {k: v.detach().clone() for k, v in params.items()}  # 1·u_1
        self.j = 1
        self.prox, self.radius = float(prox), float(radius)

    @torch.no_grad()
    def apply(self, params, release, run):
        if self.centre is None:
            raise RuntimeError("prox_projected_gd: begin() a proximal call first")
        g = release.value.lift(params)
        lr = 1.0 / (self.prox * self.j)
        moved = {}
        for k, u in params.items():
            step = g[k].to(u.dtype) + 2.0 * self.prox * (u - self.centre[k])
            moved[k] = u - lr * step - self.centre[k]
        dist = _norm(moved.values())
        shrink = 1.0 if dist <= self.radius else self.radius / dist
        self.j += 1
        for k, u in params.items():
            u.copy_(self.centre[k] + shrink * moved[k])
            self.acc[k].add_(u, alpha=float(self.j))

    def average(self) -> dict[str, torch.Tensor]:
        J = self.j
        return {k: a * (2.0 / (J * (J + 1))) for k, a in self.acc.items()}

    def state_dict(self):
        return {"centre": self.centre, "acc": self.acc, "j": self.j, "prox": self.prox, "radius": self.radius}

    def load_state_dict(self, state):
        self.centre = dict(state["centre"]) if state.get("centre") else None
        self.acc = {k: v.clone() for k, v in state["acc"].items()} if state.get("acc") else None
        self.j = int(state.get("j", 0))
        self.prox = float(state.get("prox", 0.0))
        self.radius = float(state.get("radius", 0.0))


UPDATE_RULES = (NormalizedStep, ProxProjectedGD)
