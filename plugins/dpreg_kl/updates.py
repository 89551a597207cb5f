"""Update rules of the KL algorithms: normalised steps of a fixed length, and Alg. 4's projected GD."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpregistry import StageParams, UpdateRule
from dpregistry.spaces import DENSE


@dataclass(frozen=True)
class StepBound:
    """A public bound on the length of the update rule's last step, ‖w_t − w_{t−1}‖ (None before
    its first step): post-processing of releases, so a sensitivity may depend on it."""

    length: float | None


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


class NormalizedStep(UpdateRule):
    """w ← w − r·v/‖v‖: a step of length exactly r (KL-Spider, η_{k,t} = r_k/‖v‖).

    The controller sets r before each step (``set_length``). The rule guarantees ‖w_new − w‖ ≤ r
    in floating point (it shrinks the step by a few ulps if rounding overshoots) and provides
    :class:`StepBound` r: the SPIDER difference query clips each per-sample difference to L1·r, so
    its sensitivity is data-independent (spec §4, coupling 3).
    """

    name = "normalized_step"
    accepts = frozenset({DENSE})
    Params = StageParams
    provides = (StepBound,)

    @dataclass
    class State:
        length: float | None = None      # r of the next step, set by the controller
        step_bound: float | None = None  # r of the last step taken (the next difference query's clip needs it)

    def provide(self, kind):
        return StepBound(self.state.step_bound)

    def set_length(self, r: float) -> None:
        """The length r of the next step (the controller's r_k)."""
        if not (r > 0 and math.isfinite(r)):
            raise ValueError(f"step length must be positive and finite, got {r!r}")
        self.state.length = float(r)

    @torch.no_grad()
    def apply(self, params, release, ctx):
        if self.state.length is None:
            raise RuntimeError("normalized_step needs its length from the controller (set_length)")
        r = self.state.length
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
        self.state.step_bound = r


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

    @dataclass
    class State:
        centre: dict[str, torch.Tensor] | None = None  # c = u_1 of the current call
        acc: dict[str, torch.Tensor] | None = None     # Σ j·u_j so far
        j: int = 0                                     # the index of the current iterate u_j
        prox: float = 0.0                              # L̃1
        radius: float = 0.0                            # R

    @property
    def j(self) -> int:
        """The index j of the current iterate u_j in the call (1 after ``begin``)."""
        return self.state.j

    @torch.no_grad()
    def begin(self, params, prox: float, radius: float) -> None:
        """Start a proximal call at c = u_1 = ``params`` with L̃1 = ``prox`` and R = ``radius``."""
        self.state = self.State(centre={k: v.detach().clone() for k, v in params.items()},
                                acc={k: v.detach().clone() for k, v in params.items()},  # 1·u_1
                                j=1, prox=float(prox), radius=float(radius))

    @torch.no_grad()
    def apply(self, params, release, ctx):
        s = self.state
        if s.centre is None:
            raise RuntimeError("prox_projected_gd: begin() a proximal call first")
        g = release.value.lift(params)
        lr = 1.0 / (s.prox * s.j)
        moved = {}
        for k, u in params.items():
            step = g[k].to(u.dtype) + 2.0 * s.prox * (u - s.centre[k])
            moved[k] = u - lr * step - s.centre[k]
        dist = _norm(moved.values())
        shrink = 1.0 if dist <= s.radius else s.radius / dist
        s.j += 1
        for k, u in params.items():
            u.copy_(s.centre[k] + shrink * moved[k])
            s.acc[k].add_(u, alpha=float(s.j))

    def average(self) -> dict[str, torch.Tensor]:
        """ū = 2/(J(J+1)) Σ_{j=1}^{J} j·u_j over the call's iterates so far (J = T_A at its end)."""
        J = self.state.j
        return {k: a * (2.0 / (J * (J + 1))) for k, a in self.state.acc.items()}


UPDATE_RULES = (NormalizedStep, ProxProjectedGD)
