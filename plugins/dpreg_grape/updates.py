"""Update rules in the projected space: projected Adam (Alg. 2), projected SGD, naive DP-GaLore (Alg. 5).

Every rule here uses the DP-GRAPE Adam form (spec 003 §1.3): one scalar
α_t = η·√(1−β2^t)/(1−β1^t) and φ on √V without bias correction, so that with an identity
projector a step equals dpreg_baseline's ``adam`` (Alg. 3) bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from dpregistry import StageParams, UpdateRule, UserError
from dpregistry.averaging import AverageState, AveragesIterates, AveragingParams
from dpregistry.moments import ratio, step_size, sub_ratio_, update_moments_
from dpregistry.spaces import DENSE, PROJECTED, ProjectedAggregate, acc_dtype

from .projection import LayerSelection, side_of


@dataclass
class AdamMoments:
    """Adam moments per tensor, with a step count per tensor (a reset restarts its bias correction).

    The state of the rules below extends it, so the run saves and restores the moments."""

    m: dict[str, torch.Tensor] = field(default_factory=dict)  # first moments, by tensor
    v: dict[str, torch.Tensor] = field(default_factory=dict)  # second moments
    t: dict[str, int] = field(default_factory=dict)           # steps since each tensor's last reset

    def reset(self, k: str) -> None:
        self.m.pop(k, None)
        self.v.pop(k, None)
        self.t.pop(k, None)

    def moments(self, k: str, g: torch.Tensor, lr: float, betas: tuple[float, float]) -> float:
        """Updates tensor k's moments with gradient g (Alg. 2 l.1–3) and returns α_t."""
        if k not in self.m:
            self.m[k] = torch.zeros_like(g)
            self.v[k] = torch.zeros_like(g)
            self.t[k] = 0
        self.t[k] += 1
        t = self.t[k]
        update_moments_(self.m[k], self.v[k], g, betas)
        return step_size(lr, betas, t)

    def direction(self, k: str, g: torch.Tensor, lr: float, betas: tuple[float, float],
                  eps: float) -> tuple[torch.Tensor, float]:
        """α_t·M/(√V + φ) for gradient g (Alg. 2 l.1–4 / Alg. 3), as (M/(√V + φ), α_t)."""
        alpha = self.moments(k, g, lr, betas)
        return ratio(self.m[k], self.v[k], eps), alpha

    def step_(self, k: str, x: torch.Tensor, g: torch.Tensor, lr: float, betas: tuple[float, float],
              eps: float) -> None:
        """x ← x − α_t·M/(√V + φ) in place, in blocks (an unprojected tensor may be a whole embedding)."""
        alpha = self.moments(k, g, lr, betas)
        sub_ratio_(x, self.m[k], self.v[k], eps, alpha)


def _released(params, release):
    """(name, parameter, its released coordinates in the working dtype, its projector or None)."""
    projectors = release.value.projectors if isinstance(release.value, ProjectedAggregate) else {}
    for k, x in params.items():
        yield k, x, release.value.tensors[k].to(acc_dtype(x.dtype)), projectors.get(k)


class ProjectedAdamParams(AveragingParams):
    lr: float = Field(gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0, description="φ, on √V (no bias correction; spec §1.3)")
    moment_policy: Literal["keep", "reset"] = Field(
        default="keep", description="at a projector refresh: keep M, V in the new basis (paper) or zero them")


class ProjectedAdam(AveragesIterates, UpdateRule):
    """Adam with moments in the r-dimensional space (DP-GRAPE Alg. 2); Adam on unprojected tensors.

    W ← W − α_t·P·(M/(√V+φ)) (left) or W − α_t·(M/(√V+φ))·Pᵀ (right); P is regenerated from the
    seed that the release carries, i.e. the one the estimator projected with at this step.
    ``average``: :mod:`dpregistry.averaging` (a full-size copy of every trainable weight, which
    DP-GRAPE otherwise avoids holding beside the weights).
    """

    name = "projected_adam"
    accepts = frozenset({PROJECTED})
    Params = ProjectedAdamParams

    @dataclass
    class State(AdamMoments, AverageState):
        seen: dict[str, int] = field(default_factory=dict)  # the projector seed each tensor's moments were built in

    @torch.no_grad()
    def apply(self, params, release, ctx):
        ctx.undo_displacement()
        s, c = self.state, self.cfg
        for k, x, g, pr in _released(params, release):
            if pr is not None:
                if c.moment_policy == "reset" and s.seen.get(k, pr.seed) != pr.seed:
                    s.reset(k)
                s.seen[k] = pr.seed
            if pr is not None:
                step, alpha = s.direction(k, g, c.lr, c.betas, c.eps)
                pr.sub_back_(x, step, alpha)
            else:
                s.step_(k, x, g, c.lr, c.betas, c.eps)
        self._average_(params)


class ProjectedSGDParams(StageParams):
    lr: float = Field(gt=0)


class ProjectedSGD(UpdateRule):
    """W ← W − η·P·R̃ (left) or W − η·R̃·Pᵀ (right); plain SGD on unprojected tensors (spec §1.7)."""

    name = "projected_sgd"
    accepts = frozenset({PROJECTED})
    Params = ProjectedSGDParams

    @torch.no_grad()
    def apply(self, params, release, ctx):
        ctx.undo_displacement()
        for _, x, g, pr in _released(params, release):
            if pr is not None:
                pr.sub_back_(x, g, self.cfg.lr)
            else:
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

    @dataclass
    class State(AdamMoments):
        P: dict[str, torch.Tensor] = field(default_factory=dict)  # each projected tensor's SVD basis
        steps: int = 0                                            # the paper's t (t == 1 takes the first SVD)

    def setup(self, ctx):
        r = self.cfg.rank
        self.names = [k for k, p in ctx.params.items() if self.cfg.project.selects(k, tuple(p.shape), r)]
        if not self.names:
            raise UserError(f"galore_adam: no parameter is projected at rank {r}", key="update.project")

    def subspace(self, G: torch.Tensor) -> torch.Tensor:
        """Top-r left singular vectors (rows ≤ columns) or right singular vectors (otherwise)."""
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        r = self.cfg.rank
        return (U[:, :r] if side_of(tuple(G.shape)) == "left" else Vh[:r].transpose(0, 1)).contiguous()

    @torch.no_grad()
    def apply(self, params, release, ctx):
        ctx.undo_displacement()
        grads = release.value.lift(params)
        s, c = self.state, self.cfg
        s.steps += 1
        refresh = s.steps == 1 or s.steps % c.refresh_every == 0  # spec §1.5: "t == 1 or t mod F == 0"
        for k, x in params.items():
            g = grads[k].to(acc_dtype(x.dtype))
            if k in self.names:
                left = side_of(tuple(g.shape)) == "left"
                if refresh or k not in s.P:
                    s.P[k] = self.subspace(g)
                    if c.moment_policy == "reset":
                        s.reset(k)
                P = s.P[k]
                g = P.transpose(0, 1) @ g if left else g @ P
                step, alpha = s.direction(k, g, c.lr, c.betas, c.eps)
                step = P @ step if left else step @ P.transpose(0, 1)
                x.sub_((alpha * step).to(x.dtype))
            else:
                s.step_(k, x, g, c.lr, c.betas, c.eps)


UPDATE_RULES = (ProjectedAdam, ProjectedSGD, GaLoreAdam)
