"""Points in parameter space: flattening, public random directions, batched loss/gradient queries.

The nonsmooth oracles query a per-example loss at many points near the current parameters
(x ± δu for m directions per record). Objectives of this plugin answer such queries in one
vectorised call (they are :class:`PointQueries`: ``losses_at``/``grads_at`` on flat points); any
other objective with ``functional_losses`` is queried through ``torch.func.vmap``.
"""

from __future__ import annotations


import torch

from dpregistry import Objective, UserError
from dpregistry.spaces import acc_dtype

#: rows of directions drawn per generator call; fixed so that draws never depend on chunking
BLOCK = 4096
#: points per vmap call for objectives without a native batched query
VMAP_CHUNK = 2048


class FlatView:
    """The trainable tensors as one flat vector x ∈ R^d (in a fixed order) and back."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.names = tuple(params)
        self.shapes = tuple(tuple(p.shape) for p in params.values())
        self.numels = tuple(p.numel() for p in params.values())
        self.dim = sum(self.numels)
        first = next(iter(params.values()))
        self.dtype = acc_dtype(first.dtype)
        self.device = first.device
        # relative slack for norm bounds measured on points rounded to the parameters' dtype:
        # 1e-9 for float64 (spec 001 coupling 3), about 8e-6 for float32
        self.slack = max(1e-9, 64 * torch.finfo(first.dtype).eps)

    def flat(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """A new flat copy (never a view of the parameters, which change in place)."""
        if len(self.names) == 1:
            return params[self.names[0]].detach().reshape(-1).to(self.dtype, copy=True)
        return torch.cat([params[n].detach().reshape(-1).to(self.dtype) for n in self.names])

    def unflatten(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """[..., d] -> {name: [..., *shape]} (views of ``v``)."""
        if v.shape[-1] != self.dim:  # slicing would silently drop the rest of a longer vector
            raise ValueError(f"expected points of dimension {self.dim}, got shape {tuple(v.shape)}")
        lead = v.shape[:-1]
        out, start = {}, 0
        for n, shape, k in zip(self.names, self.shapes, self.numels):
            out[n] = v[..., start:start + k].reshape(*lead, *shape)
            start += k
        return out

    @torch.no_grad()
    def write_(self, params: dict[str, torch.Tensor], v: torch.Tensor) -> None:
        for n, t in self.unflatten(v).items():
            params[n].copy_(t.to(params[n].dtype))


def sphere(g: torch.Generator, n: int, d: int, dtype=torch.float64) -> torch.Tensor:
    """n points uniform on the unit sphere S^{d−1} (u = z/‖z‖, z ~ N(0, I)), in BLOCK draws."""
    out = []
    for start in range(0, n, BLOCK):
        z = torch.randn(min(BLOCK, n - start), d, generator=g, dtype=torch.float64)
        out.append(z / z.norm(dim=1, keepdim=True))
    return (torch.cat(out) if out else torch.zeros(0, d, dtype=torch.float64)).to(dtype)


def ball(g: torch.Generator, n: int, d: int, radius: float, dtype=torch.float64) -> torch.Tensor:
    """n points uniform in the ball of radius ``radius``: radius·r^{1/d}·u, r ~ U[0,1], u ~ U_S."""
    u = sphere(g, n, d)
    r = torch.cat([torch.rand(min(BLOCK, n - s), generator=g, dtype=torch.float64)
                   for s in range(0, n, BLOCK)]) if n else torch.zeros(0, dtype=torch.float64)
    return (radius * r.pow(1.0 / d).unsqueeze(1) * u).to(dtype)


def step_generator(ctx, purpose: str, step: int, side: int) -> torch.Generator:
    """Public randomness of one step's directions: a function of (seed, purpose, step, side) only.

    Directions are drawn slot after slot in a fixed order and in chunks that depend only on the
    batch size, m and d, so a slot's directions never depend on which record fills it: two
    neighbouring data sets see the same directions in every slot ("coupled randomness",
    spec 002 §2.2).
    """
    return ctx.rng.generator(purpose, step, side)


def secret_generator(ctx, purpose: str, step: int, side: int) -> torch.Generator:
    """A generator from the run's secret randomness, for draws a privacy bound rests on.

    Public generators are a function of the recipe's seed, which whoever chooses the data may know;
    a bound that holds only with high probability over the draws (spec 002 §2.2) needs draws they
    cannot predict. Reproducible in the reproducible and keyed noise modes, fresh in secure mode;
    identical on every rank.
    """
    return ctx.rng.secret(purpose, step, side).generator()


class PointQueries:
    """What an objective adds to answer the oracles' queries natively: per-example losses (and
    gradients) at many flat points in one vectorised call, and the Lipschitz constant that makes the
    paper's sensitivity bounds hold without clipping."""

    #: every f(·; z) is L-Lipschitz with this L (None: unknown, only clipped modes are private)
    lipschitz: float | None = None

    def losses_at(self, points: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """f(points_k; record indices_k), [N] for points [N, d] and indices [N]."""
        raise NotImplementedError

    def grads_at(self, points: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The gradient of ``losses_at`` in the point, [N, d] (first-order oracles only)."""
        raise NotImplementedError


class PointQuery:
    """Per-example losses and gradients of an objective at arbitrary flat points.

    ``losses(points [N, d], indices [N]) -> [N]`` is f(points_k; record indices_k);
    ``grads(points, indices) -> [N, d]`` its gradient in the point.
    """

    def __init__(self, objective, view: FlatView):
        self.objective = objective
        self.view = view
        self.native = isinstance(objective, PointQueries)

    @staticmethod
    def check(objective, need_grad: bool = False) -> None:
        if isinstance(objective, PointQueries):
            if need_grad and type(objective).grads_at is PointQueries.grads_at:
                raise UserError(f"objective {objective.name!r} has losses_at but no grads_at", key="objective")
            return
        if type(objective).functional_losses is Objective.functional_losses:
            raise UserError(f"objective {objective.name!r} cannot be queried at arbitrary points (it implements "
                            "neither losses_at nor functional_losses)", key="objective")

    def _one(self):
        obj, view = self.objective, self.view

        def one(p, i):
            return obj.functional_losses(view.unflatten(p), i.unsqueeze(0))[0]
        return one

    @torch.no_grad()
    def losses(self, points: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self.objective.losses_at(points, indices).to(points.dtype)
        from torch.func import vmap

        f = vmap(self._one())
        pdt = self._param_dtype()
        outs = [f(points[s:s + VMAP_CHUNK].to(pdt), indices[s:s + VMAP_CHUNK]).to(points.dtype)
                for s in range(0, len(points), VMAP_CHUNK)]
        return torch.cat(outs) if outs else points.new_zeros(0)

    def grads(self, points: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self.native:
            with torch.no_grad():
                return self.objective.grads_at(points, indices).to(points.dtype)
        from torch.func import grad, vmap

        f = vmap(grad(self._one()))
        pdt = self._param_dtype()
        outs = [f(points[s:s + VMAP_CHUNK].to(pdt), indices[s:s + VMAP_CHUNK]).detach().to(points.dtype)
                for s in range(0, len(points), VMAP_CHUNK)]
        return torch.cat(outs) if outs else points.new_zeros(0, points.shape[1])

    def _param_dtype(self):
        return next(iter(self.objective.params().values())).dtype