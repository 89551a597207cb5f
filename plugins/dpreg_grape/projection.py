"""Which layers DP-GRAPE projects, how (side, shape), and with which seeded projector at each step.

Spec 003 §1.1: P_ℓ ∈ R^{k×r} with entries N(0, 1/r), regenerated from a per-layer seed. The side
is chosen by shape: left (R = PᵀG, P over the rows) when rows ≤ columns, right (R = G·P, P over the
columns) otherwise. Seeds refresh when t mod F == 0 (t = 1..T), and the initial seeds exist before
step 1 [AMBIG in the paper; spec §1.1]. A seed is a pure function of (run seed, period, layer
name): the estimator and the update rule, every micro-batch and every replica regenerate the same
P from the step alone, and a resumed run needs no projector state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

from dpregistry.spaces import Projector

#: parameters never projected by default: embeddings, heads, poolers (spec §1.2; paper: "embedding
#: layers and language modeling head [are] not projected"). LayerNorm and biases are not 2-D.
DEFAULT_EXCLUDE = [r"embed", r"(^|\.)lm_head\.", r"(^|\.)classifier\.", r"(^|\.)pooler\.", r"(^|\.)head\.",
                   r"(^|\.)score\."]


class LayerSelection(BaseModel):
    """Which 2-D weights are projected: regexes on parameter names and the rule min(m, n) > r."""

    model_config = ConfigDict(extra="forbid")
    include: list[str] = Field(default_factory=list, description="regexes; empty: every Linear weight")
    exclude: list[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    min_dim_gt_rank: bool = Field(default=True, description="project only when min(m, n) > r")
    embeddings: bool = Field(default=False, description="project embedding tables too (the paper does not): their "
                             "Adam moments are then V·r, not V·H; ``exclude`` still applies to their names")

    def selects(self, name: str, shape: tuple[int, ...], rank: int | None) -> bool:
        if len(shape) != 2:
            return False
        if self.include and not any(re.search(p, name) for p in self.include):
            return False
        if any(re.search(p, name) for p in self.exclude):
            return False
        return not (self.min_dim_gt_rank and rank is not None and min(shape) <= rank)


def side_of(shape: tuple[int, int]) -> str:
    """left when rows ≤ columns (square: left), right otherwise (spec §1.1)."""
    return "left" if shape[0] <= shape[1] else "right"


def projected_shape(shape: tuple[int, int], side: str, rank: int) -> tuple[int, int]:
    return (rank, shape[1]) if side == "left" else (shape[0], rank)


def period(step: int, refresh_every: int) -> int:
    """The subspace period of engine step ``step`` (0-based; the paper's t = step + 1).

    Seeds change exactly when t mod F == 0; period 0 holds the initial seeds (t = 1..F−1).
    """
    return (step + 1) // refresh_every


@dataclass(frozen=True)
class IdentityProjector(Projector):
    """P = I (r = k): the projected step is the dense step, bit for bit (spec §7.8)."""

    def matrix(self, device=None, dtype=torch.float32):
        return torch.eye(self.rows, self.rank, device=device, dtype=dtype)


@dataclass(frozen=True)
class OrthogonalProjector(Projector):
    """Seeded P with orthonormal columns (Q of a Gaussian's QR); square P is orthogonal (spec §7.9)."""

    def matrix(self, device=None, dtype=torch.float32):
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed)
        a = torch.randn(self.rows, self.rank, generator=g, dtype=torch.float64)
        q, r = torch.linalg.qr(a)
        q = q * torch.sign(torch.diagonal(r))  # a unique Q (Haar distributed)
        return q.to(device=device or "cpu", dtype=dtype)


PROJECTORS = {"gaussian": Projector, "identity": IdentityProjector, "orthogonal": OrthogonalProjector}


def make_projector(kind: str, seed: int, shape: tuple[int, int], rank: int) -> Projector:
    side = side_of(shape)
    rows = shape[0] if side == "left" else shape[1]
    if kind == "identity":
        rank = rows
    return PROJECTORS[kind](seed=seed, rows=rows, rank=rank, side=side)
