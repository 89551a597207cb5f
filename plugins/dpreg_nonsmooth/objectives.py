"""Synthetic Lipschitz, nonsmooth objectives of the two specs (spec 001 §5.17–18, spec 002 §7.16–17).

Each has one trainable vector x ∈ R^d, a declared Lipschitz constant (what makes the paper's
sensitivity bounds hold without clipping), vectorised per-example losses and subgradients at
arbitrary points, and the population gradient ∇F (exact where it has a closed form, otherwise a
Monte-Carlo average on fresh held-out samples) for the Goldstein certificate:
if every y_i lies within r of x, then ‖∇F(x)‖_r ≤ ‖(1/n)Σ_i ∇F(y_i)‖ (spec 001 §0).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from typing import Callable

from dpregistry import Objective, StageParams
from dpregistry.objectives import DTYPES, require_memory

from .points import PointQueries


class PointObjective(Objective, PointQueries):
    """Base: one parameter vector ``x``; per-example losses/gradients at any flat points.

    Rows are gathered with ``index_select``: advanced indexing ``z[idx]`` runs a parallel kernel
    that takes milliseconds instead of microseconds when the CPU is oversubscribed.
    """

    #: the query points averaged into the output, when an O2NC algorithm composes this objective with
    #: its update rule (it sets this in its setup): ``evaluate`` then reports their certificate
    certificate_points: Callable[[], torch.Tensor | None] | None = None

    def setup(self, ctx):
        p = self.cfg
        self.dtype = DTYPES[p.dtype]
        self.dim = p.dim
        n_test = self.held_out()
        require_memory(8 * (p.n + n_test) * p.dim, f"the data ({p.n + n_test:,} records of dimension {p.dim:,})",
                       "objective.dim")
        g = torch.Generator().manual_seed(p.seed)
        self.build(g)
        self.n_train = p.n
        self.x = self.initial_point().to(self.dtype).clone()

    # -- subclasses (and losses_at, grads_at) ----------------------------------------------------

    def held_out(self) -> int:
        """Records drawn besides the training data (the memory check counts them)."""
        return 0

    def build(self, g: torch.Generator) -> None:
        raise NotImplementedError

    def initial_point(self) -> torch.Tensor:
        raise NotImplementedError

    def population_grad(self, points: torch.Tensor) -> torch.Tensor:
        """∇F at each row of ``points`` (exact, or averaged over fresh held-out samples)."""
        raise NotImplementedError

    def population_loss(self, x: torch.Tensor) -> float:
        raise NotImplementedError

    # -- the Objective contract ---------------------------------------------------------------

    def params(self):
        return {"x": self.x}

    def functional_losses(self, params, indices):
        x = params["x"]
        return self.losses_at(x.expand(len(indices), -1), indices)

    def losses(self, indices):
        return self.functional_losses({"x": self.x}, indices)

    def certificate(self, points: torch.Tensor) -> float:
        """‖(1/n)Σ_i ∇F(y_i)‖: bounds the Goldstein norm at radius max_i ‖y_i − x‖ of any x."""
        return float(self.population_grad(points.to(self.dtype)).mean(0).norm())

    @torch.no_grad()
    def evaluate(self):
        x = self.x.detach()
        out = {"loss": self.population_loss(x), "grad_norm": float(self.population_grad(x[None]).norm())}
        points = self.certificate_points() if self.certificate_points is not None else None
        if points is not None and len(points):
            out["certificate"] = self.certificate(points)
        return out


class _Base(StageParams):
    dim: int = Field(default=5, gt=0, description="d")
    n: int = Field(default=40_000, gt=0, description="training records")
    seed: int = Field(default=0, ge=0, description="data seed")
    dtype: Literal["float32", "float64"] = "float64"


# ------------------------------------------------------------------------------------------
# ‖x − z‖₁/√d (spec 001 §5.17)
# ------------------------------------------------------------------------------------------


class L1Params(_Base):
    noise_std: float = Field(default=0.3, ge=0, description="z ~ N(μ, s²I), μ = linspace(−1, 1, d)")
    init: float = Field(default=3.0, description="x₀ = init·1")


def _norm_cdf(a):
    return 0.5 * (1 + torch.erf(a / math.sqrt(2)))


class L1Distance(PointObjective):
    """f(x; z) = ‖x − z‖₁/√d with z ~ N(linspace(−1, 1, d), s²I): convex, nonsmooth, 1-Lipschitz."""

    name = "l1_distance"
    Params = L1Params
    lipschitz = 1.0

    def build(self, g):
        p = self.cfg
        self.mu = torch.linspace(-1, 1, p.dim, dtype=torch.float64) if p.dim > 1 else torch.zeros(1, dtype=torch.float64)
        self.z = (self.mu + p.noise_std * torch.randn(p.n, p.dim, generator=g, dtype=torch.float64)).to(DTYPES[p.dtype])

    def initial_point(self):
        return torch.full((self.cfg.dim,), float(self.cfg.init), dtype=torch.float64)

    def losses_at(self, points, indices):
        return (points - self.z.index_select(0, indices)).abs().sum(-1) / math.sqrt(self.dim)

    def grads_at(self, points, indices):
        return torch.sign(points - self.z.index_select(0, indices)) / math.sqrt(self.dim)

    def population_grad(self, points):
        if self.cfg.noise_std == 0:
            return (torch.sign(points.double() - self.mu) / math.sqrt(self.dim)).to(points.dtype)
        a = (points.double() - self.mu) / self.cfg.noise_std
        return ((2 * _norm_cdf(a) - 1) / math.sqrt(self.dim)).to(points.dtype)

    def population_loss(self, x):
        s = self.cfg.noise_std
        if s == 0:
            return float((x.double() - self.mu).abs().sum() / math.sqrt(self.dim))
        a = (x.double() - self.mu) / s
        phi = torch.exp(-a * a / 2) / math.sqrt(2 * math.pi)
        return float((s * (2 * phi + a * (2 * _norm_cdf(a) - 1))).sum() / math.sqrt(self.dim))

    def min_loss(self) -> float:
        return math.sqrt(self.dim) * self.cfg.noise_std * math.sqrt(2 / math.pi)


# ------------------------------------------------------------------------------------------
# ring |‖x − z‖ − r| (spec 001 §5.18) or |‖x‖ − r| + <ξ, x> (spec 002 §7.17)
# ------------------------------------------------------------------------------------------


class RingParams(_Base):
    radius: float = Field(default=1.0, ge=0, description="r (0: the norm ‖x − z‖)")
    noise: Literal["shift", "linear"] = Field(
        default="shift", description="shift: |‖x − z‖ − r|, z ~ N(0, s²I) (L = 1); "
                                     "linear: |‖x‖ − r| + <ξ, x>, ξ uniform on the sphere of radius s (L = 1 + s)")
    noise_std: float = Field(default=0.1, ge=0, description="s")
    init_radius: float = Field(default=3.0, gt=0, description="x₀ = init_radius·1/√d")
    n_test: int = Field(default=4000, gt=0, description="fresh samples for the Monte-Carlo ∇F (shift)")


class Ring(PointObjective):
    """The ring |‖x − z‖ − r|: nonconvex, nonsmooth on the sphere and at z (1-Lipschitz, or 1 + s)."""

    name = "ring"
    Params = RingParams

    def held_out(self):
        return self.cfg.n_test

    def build(self, g):
        p = self.cfg
        dt = DTYPES[p.dtype]
        if p.noise == "shift":
            self.z = (p.noise_std * torch.randn(p.n, p.dim, generator=g, dtype=torch.float64)).to(dt)
            self.z_test = (p.noise_std * torch.randn(p.n_test, p.dim, generator=g, dtype=torch.float64)).to(dt)
            self.lipschitz = 1.0
        else:
            u = torch.randn(p.n, p.dim, generator=g, dtype=torch.float64)
            self.z = (p.noise_std * u / u.norm(dim=1, keepdim=True)).to(dt)
            self.lipschitz = 1.0 + p.noise_std

    def initial_point(self):
        return torch.full((self.cfg.dim,), self.cfg.init_radius / math.sqrt(self.cfg.dim), dtype=torch.float64)

    def losses_at(self, points, indices):
        r = self.cfg.radius
        z = self.z.index_select(0, indices)
        if self.cfg.noise == "shift":
            return ((points - z).norm(dim=-1) - r).abs()
        return (points.norm(dim=-1) - r).abs() + (z * points).sum(-1)

    @staticmethod
    def _ring_grad(v, r):
        n = v.norm(dim=-1, keepdim=True)
        return torch.sign(n - r) * v / n.clamp_min(torch.finfo(v.dtype).tiny)

    def grads_at(self, points, indices):
        z = self.z.index_select(0, indices)
        if self.cfg.noise == "shift":
            return self._ring_grad(points - z, self.cfg.radius)
        return self._ring_grad(points, self.cfg.radius) + z

    def population_grad(self, points):
        if self.cfg.noise == "linear":  # E ξ = 0
            return self._ring_grad(points, self.cfg.radius)
        out = torch.zeros_like(points)
        for s in range(0, len(self.z_test), 1024):
            zt = self.z_test[s:s + 1024].to(points.dtype)
            out += self._ring_grad(points[:, None, :] - zt[None], self.cfg.radius).sum(1)
        return out / len(self.z_test)

    def population_loss(self, x):
        r = self.cfg.radius
        if self.cfg.noise == "linear":
            return float((x.norm() - r).abs())
        return float(((x[None] - self.z_test.to(x.dtype)).norm(dim=-1) - r).abs().mean())

    def goldstein_norm(self, x: torch.Tensor, radius: float) -> float:
        """Exact min-norm element of ∂_radius F for the linear variant with r = 1 (spec 002 §7.17)."""
        if self.cfg.noise != "linear":
            raise ValueError("the closed form holds for noise: linear only")
        n = float(x.norm())
        r = self.cfg.radius
        if n <= radius or abs(n - r) <= radius:
            return 0.0
        return math.sqrt(max(0.0, 1 - radius ** 2 / n ** 2))


# ------------------------------------------------------------------------------------------
# min of norms (spec 001 §5.18)
# ------------------------------------------------------------------------------------------


class MinNormsParams(_Base):
    centers: int = Field(default=3, gt=0, description="k")
    center_scale: float = Field(default=1.0, gt=0, description="c_j ~ N(0, scale²I)")
    init_radius: float = Field(default=3.0, gt=0, description="x₀ = init_radius·1/√d")


class MinOfNorms(PointObjective):
    """f(x; z) = min_j ‖x − c_j‖ + <z, x>/10, z uniform in the unit ball: nonconvex, 1.1-Lipschitz."""

    name = "min_of_norms"
    Params = MinNormsParams
    lipschitz = 1.1

    def build(self, g):
        p = self.cfg
        dt = DTYPES[p.dtype]
        self.c = (p.center_scale * torch.randn(p.centers, p.dim, generator=g, dtype=torch.float64)).to(dt)
        u = torch.randn(p.n, p.dim, generator=g, dtype=torch.float64)
        r = torch.rand(p.n, 1, generator=g, dtype=torch.float64).pow(1.0 / p.dim)
        self.z = (r * u / u.norm(dim=1, keepdim=True)).to(dt)

    def initial_point(self):
        return torch.full((self.cfg.dim,), self.cfg.init_radius / math.sqrt(self.cfg.dim), dtype=torch.float64)

    def _dist(self, points):
        return (points[..., None, :] - self.c.to(points.dtype)).norm(dim=-1)  # [..., k]

    def losses_at(self, points, indices):
        # amin, not min(dim): torch 2.13 CPU takes ~10 ms for a (values, indices) reduction of a tiny tensor
        return self._dist(points).amin(-1) + (self.z.index_select(0, indices) * points).sum(-1) / 10

    def _min_grad(self, points):
        j = self._dist(points).argmin(-1)
        v = points - self.c.to(points.dtype).index_select(0, j.reshape(-1)).view_as(points)
        return v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)

    def grads_at(self, points, indices):
        return self._min_grad(points) + self.z.index_select(0, indices) / 10

    def population_grad(self, points):  # E z = 0
        return self._min_grad(points)

    def population_loss(self, x):
        return float(self._dist(x).amin())


OBJECTIVES = (L1Distance, Ring, MinOfNorms)
