"""Estimators: per-example first-order gradients, and the two-point zeroth-order estimate."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dpregistry import Estimator, Objective, StageParams, UserError
from dpregistry.directions import Direction
from dpregistry.persample import (PASSES_HELP, GradSampler, LayerGradients, check_passes,
                                  layer_gradients)
from dpregistry.zeroth_order import central_differences
from dpregistry.spaces import DENSE, SEEDED_DIRECTION, DenseContribution, DirectionContribution, acc_dtype


def empty_dense(params) -> DenseContribution:
    """The contribution of an empty batch (Poisson can draw one): sums to zero in every tensor."""
    return DenseContribution(per_example={k: torch.zeros((0,) + tuple(p.shape), dtype=acc_dtype(p.dtype),
                                                         device=p.device) for k, p in params.items()},
                             losses=torch.zeros(0), indices=torch.zeros(0, dtype=torch.int64))


class PerExampleGradParams(StageParams):
    backend: Literal["auto", "hooks", "functorch"] = Field(
        default="auto", description="hooks: ghost norms + book-keeping (lean); functorch: vmap(grad)")
    passes: Literal[1, 2] = Field(default=1, description=PASSES_HELP)


class PerExampleGrad(Estimator):
    """First-order per-example gradients (dense space), one contribution per micro-batch.

    The hooks backend never materialises a per-example gradient of a layer where the ghost norm
    is cheaper (see dpregistry.persample); functorch is for functional objectives without a module.
    """

    name = "per_example_grad"
    user_level = True
    space = DENSE
    Params = PerExampleGradParams
    needs = (Objective,)
    provides = (LayerGradients,)  # for per-layer clipping (the hooks backend)

    def setup(self, ctx):
        objective = ctx.need(Objective)
        module = objective.module()
        backend = self.cfg.backend
        if backend == "auto":
            backend = "hooks" if module is not None else "functorch"
        if backend == "hooks" and module is None:
            raise UserError("per_example_grad backend 'hooks' needs an objective with a torch module",
                            key="estimator.backend")
        if backend == "functorch" and type(objective).functional_losses is Objective.functional_losses:
            instead = "; use backend: hooks" if module is not None else ", nor a torch module for the hooks"
            raise UserError(f"per_example_grad backend 'functorch' needs per-example losses as a function of the "
                            f"parameters, and objective {objective.name!r} has none (functional_losses){instead}",
                            key="estimator.backend")
        if self.cfg.passes == 2 and backend != "hooks":
            raise UserError("per_example_grad passes: 2 needs the hooks backend (an objective with a torch module)",
                            key="estimator.passes")
        self.backend = backend
        check_passes(self.cfg.passes, ctx)
        self.sampler = GradSampler(module, ctx.params, passes=self.cfg.passes) if backend == "hooks" else None
        if self.sampler is not None:
            self.sampler.check_model(objective.losses, objective.n_train, ctx.micro_batch_size)

    def provide(self, kind):
        return layer_gradients(self.sampler)

    def contributions(self, objective, indices, ctx):
        if len(indices) == 0:
            yield empty_dense(ctx.params)
            return
        for chunk in ctx.micro_batches(indices):
            if self.backend == "hooks":
                with torch.enable_grad(), self.sampler.capture(len(chunk)):
                    losses = objective.losses(chunk)
                yield self.sampler.contribution(losses, indices=chunk)
            else:
                yield self._functorch(objective, chunk, ctx)

    def _functorch(self, objective, chunk, ctx):
        from torch.func import grad, vmap

        params = {k: v.detach() for k, v in ctx.params.items()}

        def one(p, i):
            return objective.functional_losses(p, i.unsqueeze(0))[0]

        grads = vmap(grad(one), in_dims=(None, 0))(params, chunk)
        with torch.no_grad():
            losses = objective.functional_losses(params, chunk)
        return DenseContribution(per_example=grads, losses=losses, indices=chunk)


class ZOParams(StageParams):
    smoothing: float = Field(default=1e-3, gt=0, alias="lambda", description="λ, the perturbation size")
    direction: Literal["gaussian", "sphere", "rademacher"] = Field(
        default="gaussian", description="u ~ N(0, I) (practice), uniform on the sphere of radius √d (theory), or "
                                        "entries ±1 (an option: ‖u‖² = d as on the sphere, several times cheaper "
                                        "parameter sweeps; dpregistry.directions gives its moments)")


class ZOTwoPoint(Estimator):
    """Two-point zeroth-order estimate: per-example (f(x+λu) − f(x−λu))/2λ on one shared seeded u.

    u is data-independent and regenerated from a public per-step seed, tensor by tensor, in place.
    The parameters are left at x − λu; the update rule restores them in the same sweep as the
    update (three sweeps per step), or the engine does if the step stops early.
    """

    name = "zo_two_point"
    user_level = True
    space = SEEDED_DIRECTION
    Params = ZOParams

    def setup(self, ctx):
        self._probed = False

    def contributions(self, objective, indices, ctx):
        names = tuple(ctx.params)
        u = Direction(ctx.rng.seed("direction", ctx.step), self.cfg.direction)
        lam = self.cfg.smoothing
        # A forward that mixes a batch moves every example's difference: probed at the first step
        # (at setup it would make a head-only objective encode its data early)
        values, mid = central_differences(objective, indices, ctx, u, lam, probe=not self._probed)
        self._probed = True
        yield DirectionContribution(values=values, direction=u, names=names, losses=mid, indices=indices)


ESTIMATORS = (PerExampleGrad, ZOTwoPoint)
