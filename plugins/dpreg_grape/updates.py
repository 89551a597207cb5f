"""Update rules in the projected space: projected Adam (Alg. 2), projected SGD, naive DP-GaLore (Alg. 5).

Every rule here uses the DP-GRAPE Adam form (spec 003 §1.3): one scalar
α_t = η·√(1−β2^t)/(1−β1^t) and φ on √V without bias correction, so that with an identity
projector a step equals dpreg_baseline's ``adam`` (Alg. 3) bit for bit.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from dpregistry import StageParams, UpdateRule, UserError
from dpregistry.spaces import DENSE, PROJECTED, acc_dtype

from .projection import LayerSelection, side_of


class _AdamMoments:
    """Adam moments per tensor, with a step count per tensor (a reset restarts its bias correction)."""

    def __init__(self, betas, eps):
        self.b1, self.b2 = betas
        self.eps = eps
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t: dict[str, int] = {}

    def reset(self, k: str) -> None:
        self.m.pop(k, None)
        self.v.pop(k, None)
        self.t.pop(k, None)

    def direction(self, k: str, g: torch.Tensor, lr: float) -> tuple[torch.Tensor, float]:
        """α_t·M/(√V + φ) for gradient g (Alg. 2 l.1–4 / Alg. 3)."""
        if k not in self.m:
            self.m[k] = torch.zeros_like(g)
            self.v[k] = torch.zeros_like(g)
            self.t[k] = 0
        self.t[k] += 1
        t = self.t[k]
        alpha = lr * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        m, v = self.m[k], self.v[k]
        m.mul_(self.b1).add_(g, alpha=1 - self.b1)
        v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
        return m / (v.sqrt() + self.eps), alpha

    def state_dict(self):
        return {"m": dict(self.m), "v": dict(self.v), "t": dict(self.t)}

    def load_state_dict(self, s):
        self.m, self.v = dict(s.get("m", {})), dict(s.get("v", {}))
        self.t = {k: int(v) for k, v in s.get("t", {}).items()}


def _released(params, release):
    """(name, parameter, its released coordinates in the working dtype, its projector or None)."""
    projectors = getattr(release.value, "projectors", {})
    for k, x in params.items():
        yield k, x, release.value.tensors[k].to(acc_dtype(x.dtype)), projectors.get(k)


class ProjectedAdamParams(StageParams):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0, description="φ, on √V (no bias correction; spec §1.3)")
    moment_policy: Literal["keep", "reset"] = Field(
        default="keep", description="at a projector refresh: keep M, V in the new basis (paper) or zero them")


class ProjectedAdam(UpdateRule):
    """Adam with moments in the r-dimensional space (DP-GRAPE Alg. 2); Adam on unprojected tensors.

    W ← W − α_t·P·(M/(√V+φ)) (left) or W − α_t·(M/(√V+φ))·Pᵀ (right); P is regenerated from the
    seed that the release carries, i.e. the one the estimator projected with at this step.
    """

    name = "projected_adam"
    accepts = frozenset({PROJECTED})
    Params = ProjectedAdamParams

    def setup(self, run):
        self.moments = _AdamMoments(self.cfg.betas, self.cfg.eps)
        self.seen: dict[str, int] = {}  # the projector seed each tensor's moments were built in

    @torch.no_grad()
    def apply(self, params, release, run):
        run.undo_displacement()
        for k, x, g, pr in _released(params, release):
            if pr is not None:
                if self.cfg.moment_policy == "reset" and self.seen.get(k, pr.seed) != pr.seed:
                    self.moments.reset(k)
                self.seen[k] = pr.seed
            step, alpha = self.moments.direction(k, g, self.cfg.lr)
            if pr is not None:
                step = pr.back(step)
            x.sub_((alpha * step).to(x.dtype))

    def state_dict(self):
        return {"moments": self.moments.state_dict(), "seen": dict(self.seen)}

    def load_state_dict(self, state):
        self.moments.load_state_dict(state.get("moments", {}))
        self.seen = {k: int(v) for k, v in state.get("seen", {}).items()}


class ProjectedSGDParams(StageParams):
    lr: float = Field(gt=0)


class ProjectedSGD(UpdateRule):
    """W ← W − η·P·R̃ (left) or W − η·R̃·Pᵀ (right); plain SGD on unprojected tensors (spec §1.7)."""

    name = "projected_sgd"
    accepts = frozenset({PROJECTED})
    Params = ProjectedSGDParams

    @torch.no_grad()
    def apply(self, params, release, run):
        run.undo_displacement()
        for _, x, g, pr in _released(params, release):
            if pr is not None:
                g = pr.back(g)
            x.sub_((self.cfg.lr * g).to(x.dtype))


class GaLoreParams(StageParams):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    rank: int = Field(default=16, gt=0)
    refresh_every: int = Field(default=100, gt=0, description="F: a new SVD when t == 1 or t mod F == 0")
    project: LayerSelection = Field(default_factory=LayerSelection)
    moment_policy: Literal["keep", "reset"] = "keep"


class GaLoreAdam(UpdateRule):
    """Naive DP-GaLore (Alg. 5): project the *privatized* dense gradient onto its top-r singular
    subspace (SVD every F steps: post-processing, no privacy cost), Adam in that subspace.

    Privatization happens in the full space before any projection, so the estimator stores dense
    per-example gradients and the noise is d-dimensional; only the optimizer state is small.
    """

    name = "galore_adam"
    accepts = frozenset({DENSE})
    Params = GaLoreParams

    def setup(self, run):
        r = self.cfg.rank
        self.names = [k for k, p in run.params.items() if self.cfg.project.selects(k, tuple(p.shape), r)]
        if not self.names:
            raise UserError(f"galore_adam: no parameter is projected at rank {r}", key="update.project")
        self.moments = _AdamMoments(self.cfg.betas, self.cfg.eps)
        self.P: dict[str, torch.Tensor] = {}
        self.t = 0

    def subspace(self, G: torch.Tensor) -> torch.Tensor:
        """Top-r left singular vectors (rows ≤ columns) or right singular vectors (otherwise)."""
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        r = self.cfg.rank
        return (U[:, :r] if side_of(tuple(G.shape)) == "left" else Vh[:r].transpose(0, 1)).contiguous()

    @torch.no_grad()
    def apply(self, params, release, run):
        run.undo_displacement()
        grads = release.value.lift(params)
        self.t += 1
        refresh = self.t == 1 or self.t % self.cfg.refresh_every == 0  # spec §1.5: "t == 1 or t mod F == 0"
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if k in self.names:
                left = side_of(tuple(g.shape)) == "left"
                if refresh or k not in self.P:
                    self.P[k] = self.subspace(g)
                    if self.cfg.moment_policy == "reset":
                        self.moments.reset(k)
                P = self.P[k]
                g = P.transpose(0, 1) @ g if left else g @ P
                step, alpha = self.moments.direction(k, g, self.cfg.lr)
                step = P @ step if left else step @ P.transpose(0, 1)
            else:
                step, alpha = self.moments.direction(k, g, self.cfg.lr)
            x.sub_((alpha * step).to(x.dtype))

    def state_dict(self):
        return {"moments": self.moments.state_dict(), "P": dict(self.P), "t": self.t}

    def load_state_dict(self, state):
        self.moments.load_state_dict(state.get("moments", {}))
        self.P = dict(state.get("P", {}))
        self.t = int(state.get("t", 0))


UPDATE_RULES = (ProjectedAdam, ProjectedSGD, GaLoreAdam)
