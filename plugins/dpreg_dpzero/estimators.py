"""The vector form of the two-point estimator, for DPGD-0th (DPZero paper, Alg. 1).

Per example it computes the same scalar central difference as ``zo_two_point``,
Δ_i = (f(x+λu; ξ_i) − f(x−λu; ξ_i))/(2λ), but hands the privatizer the *vector* g_i = Δ_i·u in
the ``vector_zo`` space: clipping is on ‖Δ_i·u‖ = |Δ_i|·‖u‖ (so C bounds the vector norm, spec §7
coupling 2), and the clipped sum is lifted to dense coordinates, so the privacy noise is
d-dimensional. With one direction it draws u from the same public seed as ``zo_two_point``, so
the two algorithms see the same u_t (spec §8 G).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dpregistry import Estimator, StageParams
from dpregistry.context import Context
from dpregistry.directions import Direction
from dpregistry.spaces import VECTOR_ZO, VectorZOContribution
from dpregistry.zeroth_order import central_differences


class ZOVectorParams(StageParams):
    smoothing: float = Field(default=1e-3, gt=0, alias="lambda", description="λ, the perturbation size")
    direction: Literal["gaussian", "sphere", "rademacher"] = Field(
        default="sphere", description="u uniform on the sphere of radius √d (Alg. 1), u ~ N(0, I), or u with "
                                      "entries ±1 (an option: ‖u‖² = d as on the sphere, cheaper sweeps)")
    directions: int = Field(default=1, ge=1, description="m directions per step; the estimate averages them")


def direction_for(ctx: Context, j: int, distribution: str) -> Direction:
    """The j-th public direction of the current step (j = 0 is ``zo_two_point``'s u)."""
    seed = ctx.rng.seed("direction", ctx.step) if j == 0 else ctx.rng.seed("direction", ctx.step, j)
    return Direction(seed, distribution)


class ZOTwoPointVector(Estimator):
    """Two-point zeroth-order gradients Δ_i·u as vectors (clipped in L2, noised in d dims): DPGD-0th.

    Perturbs in place from a public seed (no parameter copy); leaves the parameters at x − λu of
    the last direction, registered with ``ctx.displace``, for the update rule to restore.
    """

    name = "zo_two_point_vector"
    space = VECTOR_ZO
    Params = ZOVectorParams

    def setup(self, ctx):
        self._probed = False

    def contributions(self, objective, indices, ctx):
        m, lam = self.cfg.directions, self.cfg.smoothing
        dirs = tuple(direction_for(ctx, j, self.cfg.direction) for j in range(m))
        cols, mids = [], []
        for j, u in enumerate(dirs):
            if j:  # restore x from the previous direction's x − λu
                ctx.undo_displacement()
            diff, mid = central_differences(objective, indices, ctx, u, lam, probe=not self._probed)
            self._probed = True  # a forward that mixes a batch: zo_two_point's probe, at the first step
            cols.append(diff / m)
            mids.append(mid)
        values = torch.stack(cols, 1)
        yield VectorZOContribution(values=values, directions=dirs, params=dict(ctx.params),
                                   losses=torch.stack(mids, 1).mean(1), indices=indices)


ESTIMATORS = (ZOTwoPointVector,)
