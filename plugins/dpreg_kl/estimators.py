"""Full-batch first-order estimators: per-record gradients, and SPIDER's anchor/difference queries.

Both yield dense per-example contributions. Objectives with closed-form per-record gradients over
*distinct* records with multiplicities (:class:`~dpreg_kl.common.GroupedRecords`, as this plugin's
are) are queried directly; any other objective with ``functional_losses`` gets per-example
gradients from ``torch.func``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpregistry import Estimator, UserError
from dpregistry.spaces import DENSE, GRADIENT, INCREMENT, DenseAggregate, DenseContribution

from .common import GroupedRecords
from .updates import StepBound


class GroupedDenseContribution(DenseContribution):
    """Per-example gradients of distinct records, each standing for ``counts[i]`` identical records.

    Clip weights are per record, so Σ_i w_i·count_i·g_i is exactly the clipped sum over all the
    records the group stands for.
    """

    def __init__(self, per_example, counts, **kw):
        super().__init__(per_example=per_example, **kw)
        self.counts = counts

    @property
    def n_records(self) -> int:
        return int(self.counts.sum())

    def grouped(self, groups, n_groups):  # a row stands for counts[i] records of its group
        c = self.counts
        return DenseContribution(per_example={k: g * c.to(g.dtype).view((-1,) + (1,) * (g.dim() - 1))
                                              for k, g in self.per_example.items()},
                                 kind=self.kind).grouped(groups, n_groups)

    def weighted_sum(self, weights):
        w = weights.to(self.counts.dtype) * self.counts
        out = {}
        for k, g in self.per_example.items():
            shape = (-1,) + (1,) * (g.dim() - 1)
            # a row of weight 0 contributes exactly 0, even when it is not finite
            keep = (w > 0).view(shape)
            out[k] = torch.where(keep, g * w.to(g.dtype).view(shape), torch.zeros((), dtype=g.dtype)).sum(0)
        return DenseAggregate(out)


def per_record(objective, params: dict[str, torch.Tensor], indices: torch.Tensor):
    """(per-example gradients {name: [m, ...]}, losses [m], counts [m] or None) at ``params``."""
    if isinstance(objective, GroupedRecords):
        keys, counts = objective.record_groups(indices)
        w = params["w"]
        return ({"w": objective.per_record_grads(w, keys)}, objective.per_record_losses(w, keys), counts)
    from torch.func import grad, vmap

    fixed = {k: v.detach() for k, v in params.items()}

    def one(p, i):
        return objective.functional_losses(p, i.unsqueeze(0))[0]

    try:
        grads = vmap(grad(one), in_dims=(None, 0))(fixed, indices)
        with torch.no_grad():
            losses = objective.functional_losses(fixed, indices)
    except NotImplementedError:
        raise UserError(f"objective {objective.name!r} has no functional_losses; the KL estimators need "
                        "per-example gradients as a function of the parameters", key="estimator") from None
    return grads, losses, None


def contribution(grads, losses, counts, indices, kind=GRADIENT, info=None) -> DenseContribution:
    """The rows of one record each name it (the run checks them against the batch); a grouped row
    stands for ``counts[i]`` records, checked by their number."""
    info = info or {}
    if counts is None:
        return DenseContribution(per_example=grads, losses=losses, kind=kind, info=info, indices=indices)
    return GroupedDenseContribution(grads, counts, losses=losses, kind=kind, info=info)


class FullBatchGrad(Estimator):
    """Per-example gradients of every record at the current parameters (grouped when records repeat)."""

    name = "kl_fullbatch_grad"
    space = DENSE

    def contributions(self, objective, indices, ctx):
        grads, losses, counts = per_record(objective, ctx.params, indices)
        yield contribution(grads, losses, counts, indices)


class SpiderFullBatch(Estimator):
    """SPIDER (KL-Spider, Alg. 1): the anchor gradient after ``reset()``, then gradient differences.

    After a reset the contribution is each record's gradient at w (a GRADIENT). After that it is
    each record's ∇f(w; x) − ∇f(w_prev; x), w_prev the point of the previous query (an INCREMENT),
    with ``info["step_bound"]``, a public bound on ‖w − w_prev‖: the update rule's
    :class:`~dpreg_kl.updates.StepBound` (normalised steps have length exactly r_k), or the measured
    distance before the rule has stepped. Both points are post-processing of releases, so the bound
    is public; the privatizer clips each difference to L1·step_bound, which bounds the sensitivity
    whatever the loss (spec §1.1).

    State: w_prev (checkpointed). The controller resets at each round start.
    """

    name = "spider_fullbatch"
    space = DENSE
    contribution_kind = INCREMENT  # it yields increments (and a GRADIENT anchor after each reset)
    needs = (StepBound,)

    @dataclass
    class State:
        prev: dict[str, torch.Tensor] | None = None  # the point of the previous query

    def reset(self):
        self.state.prev = None

    def contributions(self, objective, indices, ctx):
        here = {k: v.detach().clone() for k, v in ctx.params.items()}
        grads, losses, counts = per_record(objective, here, indices)
        prev = self.state.prev
        if prev is None:
            self.state.prev = here
            yield contribution(grads, losses, counts, indices, kind=GRADIENT)
            return
        old, _, _ = per_record(objective, prev, indices)
        moved = float(torch.sqrt(sum(((here[k] - prev[k]).double() ** 2).sum() for k in here)))
        bound = ctx.need(StepBound).length
        if bound is None:
            bound = moved
        elif moved > bound * (1 + 1e-12):
            raise RuntimeError(f"the parameters moved {moved!r} since the last query, more than the update "
                               f"rule's step bound {bound!r}")
        self.state.prev = here
        diffs = {k: grads[k] - old[k] for k in grads}
        yield contribution(diffs, losses, counts, indices, kind=INCREMENT, info={"step_bound": float(bound)})


ESTIMATORS = (FullBatchGrad, SpiderFullBatch)
