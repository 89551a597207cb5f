"""The two-point evaluation that every seeded-direction estimator shares."""

from __future__ import annotations

import torch

from .directions import Direction
from .persample import check_examples_independent, working_dtype
from .spaces import acc_dtype


@torch.no_grad()
def central_differences(objective, indices: torch.Tensor, ctx, u: Direction, lam: float, probe: bool = False):
    """Per-example (f(x+λu) − f(x−λu))/2λ and (f(x+λu) + f(x−λu))/2, in at least fp32.

    Perturbs ``ctx.params`` in place (no copy, u regenerated from its seed chunk by chunk) and leaves
    them at x − λu, registered with ``ctx.displace``: the update rule restores x in the same sweep
    as its update, or the run does if the step stops early. The displacement is registered
    before each forward pass, so a failure in either one is undone too.

    ``probe`` (an estimator's first call in a process): refuse a forward that mixes the examples of
    a batch (:func:`dpregistry.persample.check_examples_independent`) at x and at x + λu, where
    a zero-initialised head, whose losses are all log K at x, reads the mixed features.
    """
    names = tuple(ctx.params)
    tensors = list(ctx.params.values())
    # A rank whose shard is empty still sweeps (x − λu + λu is not x in floating point, so a rank
    # that skipped the perturbation would drift from the others) and returns values in the dtype
    # and device of the others' (ranks all-gather them into one tensor).
    losses = objective.losses if len(indices) else \
        (lambda _: torch.zeros(0, dtype=acc_dtype(tensors[0].dtype), device=tensors[0].device))
    def probe_here() -> None:
        if probe:
            check_examples_independent(objective.losses, objective.n_train, ctx.device, working_dtype(tensors),
                                       ctx.micro_batch_size)

    probe_here()
    u.add_(tensors, lam)
    ctx.displace(u, names, lam)
    probe_here()
    plus = losses(indices)
    u.add_(tensors, -2 * lam)
    ctx.displace(u, names, -lam)
    minus = losses(indices)
    dt = acc_dtype(plus.dtype)
    plus, minus = plus.to(dt), minus.to(dt)
    return (plus - minus) / (2 * lam), (plus + minus) / 2
