"""Coordinate spaces: what an estimator hands a privatizer, and what a privatizer hands an update rule.

Every per-example contribution lives in a space (DESIGN.md, "The five stage kinds"):

=================  ===================================  ==================================
space              per-example contribution              aggregate (what gets noised)
=================  ===================================  ==================================
dense              a full gradient per parameter          parameter-shaped tensors
seeded_direction   one scalar, all sharing u(seed)        one scalar + the seed
vector_zo          m scalars on m shared seeded dirs      dense (Σ c_j u_j, noise is d-dim)
projected          per-layer Pᵀ·G (rank r) + seeds        r-dim tensors + projector seeds
=================  ===================================  ==================================

A privatizer touches contributions only through two methods, so it works in every space and never
needs the per-example vectors to exist at full size:

* ``norms()``: each example's L2 norm in the space (may be NaN/inf: the privatizer zeroes those);
* ``weighted_sum(w)``: Σ_i w_i·c_i as an :class:`Aggregate`; an example with w_i = 0 contributes
  exactly zero, even when its values are not finite.

An aggregate is a sum (not a mean), so that micro-batches and ranks add up before noise is
drawn once. Its ``tensors`` are the released coordinates: Gaussian noise goes on every one of them.
``lift(params)`` maps it back to parameter shapes for update rules that work densely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from . import moments
from .directions import Direction
from .privacy.secret import SecretStream
from .space_names import DENSE, GRADIENT, INCREMENT, PROJECTED, SEEDED_DIRECTION, SPACES, VECTOR_ZO  # noqa: F401


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums, norms and noise are computed in at least fp32 (fp16/bf16 parameters included)."""
    return torch.promote_types(dtype, torch.float32)


def _mask_rows(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """values * w per example, with rows of weight 0 set to exactly 0 (NaN-safe)."""
    shape = (-1,) + (1,) * (values.dim() - 1)
    w = weights.to(values.dtype).view(shape)
    keep = (weights > 0).view(shape)
    return torch.where(keep, values * w, torch.zeros((), dtype=values.dtype, device=values.device))


# --------------------------------------------------------------------------------------------
# Aggregates
# --------------------------------------------------------------------------------------------


class Aggregate(ABC):
    """A (clipped) sum in some space. ``tensors`` are the coordinates that get noised."""

    space: ClassVar[str]

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def _check_compatible(self, other: "Aggregate") -> None:
        if type(other) is not type(self) or other.tensors.keys() != self.tensors.keys():
            raise ValueError("cannot add aggregates from different spaces or layouts")

    def add_(self, other: "Aggregate") -> "Aggregate":
        self._check_compatible(other)
        for k, t in self.tensors.items():
            t.add_(other.tensors[k])
        return self

    def mul_(self, c: float) -> "Aggregate":
        for t in self.tensors.values():
            t.mul_(c)
        return self

    def add_noise_(self, std: float, source) -> None:
        """Adds N(0, std²) to every coordinate, in the fixed order of ``tensors``.

        ``source`` is a :class:`~dpregistry.rng.NoiseSource` (secret, separate from every seed
        that is public)."""
        if std == 0:
            return
        tensors = [self.tensors[k] for k in sorted(self.tensors)]
        if isinstance(source, SecretStream):  # a cipher stream adds in chunks, on every core
            source.add_noise_(tensors, std)
        else:  # anything else with a randn (a test's recorder)
            SecretStream.add_noise_(source, tensors, std)

    def clone(self) -> "Aggregate":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.tensors = {k: t.clone() for k, t in self.tensors.items()}
        return new

    @abstractmethod
    def lift(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The aggregate as parameter-shaped tensors (a dense update direction)."""


class DenseAggregate(Aggregate):
    space = DENSE

    def lift(self, params):
        return {k: self.tensors[k] for k in params if k in self.tensors}


class DirectionAggregate(Aggregate):
    """One scalar coefficient on a shared seeded direction: the update is coeff·u(seed)."""

    space = SEEDED_DIRECTION

    def __init__(self, coeff: torch.Tensor, direction: Direction, names: tuple[str, ...]):
        super().__init__({"coeff": coeff.reshape(1)})
        self.direction = direction
        self.names = names

    def _check_compatible(self, other):
        super()._check_compatible(other)
        if other.direction != self.direction:
            raise ValueError("cannot add aggregates on different directions")

    @property
    def coeff(self) -> float:
        return float(self.tensors["coeff"])

    def lift(self, params):
        # Materialises u: costs d memory. Memory-free update rules use ``direction`` instead.
        us = self.direction.dense([params[n] for n in self.names], dtype=acc_dtype(next(iter(params.values())).dtype))
        return {n: u.mul_(self.coeff) for n, u in zip(self.names, us)}


@dataclass(frozen=True)
class Projector:
    """A seeded Gaussian projector P ∈ R^{k×r}, entries N(0, 1/r) (DP-GRAPE §1.1)."""

    seed: int
    rows: int
    rank: int
    side: str  # "left": R = Pᵀ G (k = out rows); "right": R = G P (k = in columns)

    def matrix(self, device=None, dtype=torch.float32) -> torch.Tensor:
        g = torch.Generator(device=device or "cpu")
        g.manual_seed(self.seed)
        p = torch.randn(self.rows, self.rank, generator=g, device=device, dtype=torch.float32)
        return p.div_(self.rank ** 0.5).to(dtype)

    def project(self, G: torch.Tensor) -> torch.Tensor:
        P = self.matrix(G.device, G.dtype)
        return P.transpose(-1, -2) @ G if self.side == "left" else G @ P

    def back(self, X: torch.Tensor) -> torch.Tensor:
        P = self.matrix(X.device, X.dtype)
        return P @ X if self.side == "left" else X @ P.transpose(-1, -2)

    @torch.no_grad()
    def sub_back_(self, W: torch.Tensor, X: torch.Tensor, alpha: float) -> None:
        """W ← W − α·back(X) in place, a block of W's rows at a time: the lifted step never exists
        at W's size (for an embedding table that transient was hundreds of MiB). The numbers are
        ``back(X) * α`` up to the GEMM's summation order; W may have a narrower dtype than X."""
        P = self.matrix(X.device, X.dtype)
        # left: back = P·X, W's rows are P's; right: back = X·Pᵀ, W's rows are X's
        rows_of, other = (P, X) if self.side == "left" else (X, P.transpose(-1, -2))
        block = max(1, moments.BLOCK // max(1, W.shape[-1]))  # whole rows, about BLOCK elements
        for i in range(0, W.shape[0], block):
            W[i:i + block].sub_((rows_of[i:i + block] @ other).mul_(alpha).to(W.dtype))


class ProjectedAggregate(Aggregate):
    """Projected coordinates per layer (``projectors[name]``) plus dense unprojected tensors."""

    space = PROJECTED

    def __init__(self, tensors: dict[str, torch.Tensor], projectors: dict[str, Projector]):
        super().__init__(tensors)
        self.projectors = projectors

    def _check_compatible(self, other):
        super()._check_compatible(other)
        if other.projectors != self.projectors:
            # micro-batches and ranks of one step must share P, or the sum mixes coordinate systems
            raise ValueError("cannot add projected aggregates on different projectors")

    def lift(self, params):
        out = {}
        for k in params:
            if k not in self.tensors:
                continue
            t = self.tensors[k]
            out[k] = self.projectors[k].back(t) if k in self.projectors else t
        return out


# --------------------------------------------------------------------------------------------
# Contributions
# --------------------------------------------------------------------------------------------


@dataclass
class Contribution(ABC):
    """Per-example contributions of one batch, in a space. See the module docstring."""

    space: ClassVar[str]
    kind: str = field(default=GRADIENT, kw_only=True)
    losses: torch.Tensor | None = field(default=None, kw_only=True)  # diagnostics only
    info: dict[str, Any] = field(default_factory=dict, kw_only=True)
    #: the training records of the rows (set by the estimator), and, in a user-level run, the user
    #: of each row (set by the run): the rows of one user are clipped as one contribution
    indices: torch.Tensor | None = field(default=None, kw_only=True)
    groups: torch.Tensor | None = field(default=None, kw_only=True)

    @property
    @abstractmethod
    def batch_size(self) -> int: ...

    @property
    def n_records(self) -> int:
        """The training records the rows stand for (one each, unless a row stands for several
        identical records)."""
        return self.batch_size

    @abstractmethod
    def norms(self) -> torch.Tensor:
        """Per-example L2 norms in this space, shape [B]."""

    @abstractmethod
    def weighted_sum(self, weights: torch.Tensor) -> Aggregate:
        """Σ_i w_i·c_i; rows with w_i = 0 contribute exactly 0 (NaN-safe)."""

    def group_norms(self, groups: torch.Tensor, n_groups: int) -> torch.Tensor:
        """‖Σ_{i in g} c_i‖ for each group g (``groups``: the group 0..n_groups−1 of each row)."""
        formed = self.grouped(groups, n_groups)
        if formed is None:
            raise NotImplementedError(f"{type(self).__name__} cannot clip groups of examples")
        return formed.norms()

    def grouped(self, groups: torch.Tensor, n_groups: int) -> "Contribution | None":
        """The contribution whose rows are the groups' sums, formed once, so that the sum a group's
        clip weight multiplies is the one its norm measured; None where the rows are not formed
        (``group_norms`` and ``weighted_sum`` then see to it). Summed anew among the other groups'
        rows, a group whose rows cancel (±10³⁰) left rounding of its own size in the sum, and
        drowned the other groups' rows in it (a review)."""
        return None

    def gather(self, comm) -> "Contribution | None":
        """The whole batch's contribution from every rank's shard, when it is small enough to send
        (per-example scalars); None means ranks all-reduce their clipped sums instead."""
        return None


@dataclass
class DenseContribution(Contribution):
    """Materialised per-example gradients, ``per_example[name]`` of shape [B, *param.shape]."""

    space: ClassVar[str] = DENSE
    per_example: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.per_example.values())).shape[0]

    def norms(self):
        sq = None
        for g in self.per_example.values():
            s = g.to(acc_dtype(g.dtype)).flatten(1).pow(2).sum(1)
            sq = s if sq is None else sq + s
        return sq.sqrt()

    def weighted_sum(self, weights):
        return DenseAggregate({k: _mask_rows(g.to(acc_dtype(g.dtype)), weights).sum(0)
                               for k, g in self.per_example.items()})

    def grouped(self, groups, n_groups):
        sums = {}
        for k, g in self.per_example.items():
            g = g.to(acc_dtype(g.dtype))
            sums[k] = torch.zeros((n_groups, *g.shape[1:]), dtype=g.dtype, device=g.device).index_add_(
                0, groups.to(g.device), g)
        return DenseContribution(per_example=sums, kind=self.kind)


@dataclass
class DirectionContribution(Contribution):
    """One scalar per example (a finite difference), all on the shared direction ``direction``."""

    space: ClassVar[str] = SEEDED_DIRECTION
    values: torch.Tensor = None  # [B]
    direction: Direction = None
    names: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]

    def norms(self):
        return self.values.to(acc_dtype(self.values.dtype)).abs()

    def weighted_sum(self, weights):
        v = _mask_rows(self.values.to(acc_dtype(self.values.dtype)), weights).sum()
        return DirectionAggregate(v, self.direction, self.names)

    def grouped(self, groups, n_groups):
        v = self.values.to(acc_dtype(self.values.dtype))
        summed = torch.zeros(n_groups, dtype=v.dtype, device=v.device).index_add_(0, groups.to(v.device), v)
        return replace(self, values=summed, losses=None, indices=None, groups=None)

    def gather(self, comm):
        return replace(self, values=comm.gather_rows(self.values),
                       losses=comm.gather_rows(self.losses) if self.losses is not None else None)


@dataclass
class VectorZOContribution(Contribution):
    """m scalars per example on m shared seeded directions: c_i = Σ_j values[i, j]·u_j.

    The clipped sum is lifted to dense coordinates, so noise is d-dimensional (DPGD-0th, Alg. 1).
    """

    space: ClassVar[str] = VECTOR_ZO
    values: torch.Tensor = None  # [B, m]
    directions: tuple[Direction, ...] = ()
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # shapes/devices of u

    @property
    def batch_size(self) -> int:
        return self.values.shape[0]

    def _dirs(self, dtype):
        tensors = list(self.params.values())
        return [torch.cat([u.flatten() for u in d.dense(tensors, dtype=dtype)]) for d in self.directions]

    def norms(self):
        """‖Σ_j v_ij·u_j‖ per row, from above: vᵀ(UUᵀ)v in float64 from the values and the
        directions the lift uses, plus its rounding bound, (γ_d + γ_{m²})·M² with M = Σ_j |v_j|·‖u_j‖
        (each Gram entry off by γ_d‖u_i‖‖u_j‖, the form's sum by γ_{m²}). In fp32 and unbounded, a
        row of 10¹⁵ in the null space of the directions (m > d) had norm 0, so it was not clipped,
        and its lift moved the sum by 10⁸·C (a review); ``weighted_sum`` lifts in float64."""
        v = self.values.to(torch.float64)
        U = torch.stack(self._dirs(acc_dtype(self.values.dtype))).to(torch.float64)  # [m, d]
        M = v.abs() @ U.norm(dim=1)
        unit = torch.finfo(torch.float64).eps / 2
        gamma = sum(n * unit / (1 - n * unit) for n in (U.shape[1], U.shape[0] ** 2))
        sq = torch.einsum("bi,ij,bj->b", v, U @ U.T, v)
        return (sq.clamp_min(0) + 2.02 * gamma * M * M).sqrt()

    def gather(self, comm):
        return replace(self, values=comm.gather_rows(self.values),
                       losses=comm.gather_rows(self.losses) if self.losses is not None else None)

    def grouped(self, groups, n_groups):
        v = self.values.to(acc_dtype(self.values.dtype))
        summed = torch.zeros((n_groups, v.shape[1]), dtype=v.dtype, device=v.device).index_add_(0, groups.to(v.device), v)
        return replace(self, values=summed, losses=None, indices=None, groups=None)

    def weighted_sum(self, weights):
        dt = acc_dtype(self.values.dtype)
        coeff = _mask_rows(self.values.to(torch.float64), weights).sum(0)  # [m], float64 as the norms
        flat = sum(c * u.to(torch.float64) for c, u in zip(coeff, self._dirs(dt)))
        out, start = {}, 0
        for k, p in self.params.items():
            out[k] = flat[start:start + p.numel()].view(p.shape).to(dt)
            start += p.numel()
        return DenseAggregate(out)
