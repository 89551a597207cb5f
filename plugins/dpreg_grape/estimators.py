"""The projected per-example estimator: each example's Pᵀ·G of every projected layer, from hooks.

For a linear layer with per-example inputs a_i [T, in] and backprops g_i [T, out], the gradient
is G_i = g_iᵀ a_i (out × in). Its projection is formed from the factors, so G_i never exists
(spec 003 §5, "fast path"):

* left  (out ≤ in):  R_i = Pᵀ G_i = (g_i P)ᵀ a_i     [r × in]
* right (out > in):  R_i = G_i P = g_iᵀ (a_i P)      [out × r]

The handler projects the backprop (or the activation) the moment autograd produces it, then
keeps the factors or R_i, whichever is smaller (dpregistry.persample.Outer): ghost norms when T²
is small, the paper's B·r·n per-sample tensors otherwise. Unprojected parameters (embeddings,
LayerNorm, biases, heads) keep the dense rules. The privatizer then clips flat over the projected
and unprojected coordinates together and adds noise to each of them (spec §1.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from dpregistry import Estimator, Objective, StageParams, UserError
from dpregistry.persample import (PASSES_HELP, EmbeddingHandler, GradSampler, HookContribution, LayerGradients,
                                  LinearHandler, Outer, check_passes, handler_for, layer_gradients)
from dpregistry.spaces import PROJECTED, ProjectedAggregate, Projector, acc_dtype

from .projection import LayerSelection, make_projector, period, projected_shape


@dataclass
class ProjectedHookContribution(HookContribution):
    """Per-example contributions in the projected space: R_i per projected layer, G_i elsewhere."""

    space: ClassVar[str] = PROJECTED
    projectors: dict[str, Projector] = field(default_factory=dict)
    #: the estimator whose ``current`` projectors the handlers read as the backward reaches them
    owner: Any = field(default=None, repr=False)

    def _run_backward(self, clip=None):
        # the backward runs when the contribution is first read: project with its own step's P even
        # if the estimator has moved on to another step's
        if self.owner is None:
            return super()._run_backward(clip)
        kept, self.owner.current = self.owner.current, self.projectors
        try:
            super()._run_backward(clip)
        finally:
            self.owner.current = kept

    def _zero(self, name, p):
        pr = self.projectors.get(name)
        if pr is None:
            return super()._zero(name, p)
        return torch.zeros(projected_shape(tuple(p.shape), pr.side, pr.rank), dtype=acc_dtype(p.dtype), device=p.device)

    def _aggregate(self, tensors):
        return ProjectedAggregate(tensors, dict(self.projectors))


class ProjectedLinearHandler(LinearHandler):
    """A Linear layer whose weight gradient is kept only in projected form (a second backward would
    project anew: ``second_pass_replays`` is not declared, so two passes keep the first's pieces)."""

    def __init__(self, estimator: "ProjectedPerExampleGrad", name: str):
        self.estimator = estimator
        self.name = name

    def weight_product(self, use, a, g):
        pr = self.estimator.current[self.name]
        P = pr.matrix(a.device, a.dtype)
        if pr.side == "left":
            return Outer(g @ P, a)   # R_i = (g_i P)ᵀ a_i = Pᵀ g_iᵀ a_i
        return Outer(g, a @ P)       # R_i = g_iᵀ (a_i P) = g_iᵀ a_i P

    def weight_shape(self, use, prod):
        pr = self.estimator.current[self.name]
        return projected_shape(tuple(use.module.weight.shape), pr.side, pr.rank)


class ProjectedEmbeddingHandler(EmbeddingHandler):
    """An embedding table (V × H) whose gradient is kept only in projected form, for a recipe that
    projects embeddings (``project: {embeddings: true, exclude: [...]}``; the paper does not). G_i is the
    scatter of the backprops g_i into the rows ids_i, so

    * right (V > H, the usual table): R_i = G_i P = scatter of g_i P into the rows ids_i   [V × r]
    * left  (V ≤ H):                  R_i = Pᵀ G_i = Σ_t P[ids_it]ᵀ g_it                   [r × H]

    and the update's moments are V·r (or r·H) numbers instead of V·H."""

    def __init__(self, estimator: "ProjectedPerExampleGrad", name: str):
        self.estimator = estimator
        self.name = name

    def on_backprop(self, use):
        super().on_backprop(use)
        rows = use.state["weight"]
        pr = self.estimator.current[self.name]
        if pr.side == "right":
            rows.g = rows.g @ pr.matrix(rows.g.device, rows.g.dtype)
        else:
            P = pr.matrix(rows.g.device, rows.g.dtype)
            use.state["weight"] = Outer(P[rows.ids], rows.g)


def select_layers(module: nn.Module, params: dict[str, torch.Tensor], sel: LayerSelection,
                  rank: int | None) -> dict[int, str]:
    """The Linear layers whose weight is projected: module id -> weight name (spec §1.2, §6.5).
    Embedding tables too where the selection asks for them (``embeddings: true``).

    A weight that is tied to another layer (an LM head sharing the embedding) stays dense.
    """
    names = {id(p): n for n, p in params.items()}
    uses: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    out = {}
    for m in module.modules():
        kinds = (nn.Linear, nn.Embedding) if sel.embeddings else (nn.Linear,)
        if type(m) not in kinds or id(m.weight) not in names or uses[id(m.weight)] > 1:
            continue
        name = names[id(m.weight)]
        if sel.selects(name, tuple(m.weight.shape), rank):
            out[id(m)] = name
    return out


class ProjectedParams(StageParams):
    rank: int = Field(default=16, gt=0, description="r, the projection rank")
    refresh_every: int = Field(default=100, gt=0, description="F: fresh projector seeds when t mod F == 0")
    projector: Literal["gaussian", "identity", "orthogonal"] = Field(
        default="gaussian", description="gaussian: N(0, 1/r) entries (DP-GRAPE); identity/orthogonal: for tests")
    project: LayerSelection = Field(default_factory=LayerSelection)
    passes: Literal[1, 2] = Field(default=1, description=PASSES_HELP)


class ProjectedPerExampleGrad(Estimator):
    """DP-GRAPE's per-example gradients: Pᵀ·G per projected Linear layer, built from hooks."""

    name = "projected_per_example_grad"
    user_level = True
    space = PROJECTED
    Params = ProjectedParams
    needs = (Objective,)
    provides = (LayerGradients,)

    def setup(self, ctx):
        objective = ctx.need(Objective)
        module = objective.module()
        if module is None:
            raise UserError("projected_per_example_grad needs an objective with a torch module", key="estimator")
        self.rng = ctx.rng  # public randomness: the projector seeds
        sel, r = self.cfg.project, self.cfg.rank
        #: projected layers: module id -> weight name, and weight name -> weight shape
        self.projected = select_layers(module, ctx.params, sel, r)
        self.shapes = {name: tuple(m.weight.shape) for m in module.modules()
                       if (name := self.projected.get(id(m))) is not None}
        if not self.projected:
            raise UserError(f"no layer is projected (rank {r}, include {sel.include or 'all'}, exclude {sel.exclude}); "
                            "lower the rank or widen estimator.project", key="estimator.project")
        self.current: dict[str, Projector] = self.projectors(ctx.step)
        check_passes(self.cfg.passes, ctx)
        self.sampler = GradSampler(module, ctx.params, handler_for=self._handler_for, passes=self.cfg.passes)
        self.sampler.check_model(objective.losses, objective.n_train, ctx.micro_batch_size)

    def provide(self, kind):
        return layer_gradients(self.sampler)

    def _handler_for(self, module):
        name = self.projected.get(id(module))
        if name is None:
            return handler_for(module)
        return (ProjectedEmbeddingHandler if isinstance(module, nn.Embedding) else ProjectedLinearHandler)(self, name)

    def projectors(self, step: int) -> dict[str, Projector]:
        """The projectors of engine step ``step``: one seed per layer per period (public randomness)."""
        k = period(step, self.cfg.refresh_every)
        return {name: make_projector(self.cfg.projector, self.rng.seed("grape_projector", k, name),
                                     shape, self.cfg.rank)
                for name, shape in self.shapes.items()}

    def contributions(self, objective, indices, ctx):
        # Fixed for the whole step: every micro-batch projects with the P the update will use.
        self.current = self.projectors(ctx.step)
        if len(indices) == 0:
            yield ProjectedHookContribution(n=0, params=ctx.params, projectors=self.current,
                                            losses=torch.zeros(0), finite=torch.zeros(0, dtype=torch.bool),
                                            indices=torch.zeros(0, dtype=torch.int64))
            return
        for chunk in ctx.micro_batches(indices):
            with torch.enable_grad(), self.sampler.capture(len(chunk)):
                losses = objective.losses(chunk)
            yield self.sampler.contribution(losses, cls=ProjectedHookContribution, projectors=self.current,
                                            owner=self, indices=chunk)


ESTIMATORS = (ProjectedPerExampleGrad,)
