"""What the KL stages exchange: the objective's declared constants and its closed-form records.

An objective offers these by subclassing the classes below (as this plugin's objectives do); the
stages that use them check with ``isinstance``, so a third-party objective takes part by
subclassing too, and a recipe whose objective does not is refused in one line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dpregistry import UserError


@dataclass(frozen=True)
class KLConstants:
    """Constants of an objective that do not depend on the private data (only on the public design,
    the regularisation and public bounds), read where a recipe says ``auto``. A wrong constant
    hurts utility, never privacy: privacy comes from clipping (spec 004 §4, coupling 8)."""

    kappa: float                    # κ of the (γ, κ)-KL* condition
    gamma: float                    # γ of the KL* condition
    lipschitz: float                # L0: a record's gradient norm on the declared ball
    f0: float                       # F0 ≥ F(w0) − F*
    weak_convexity: float           # L̃1: F + (L̃1/2)‖·‖² is convex (0 for a convex F)
    smoothness: float | None = None  # L1: per-record smoothness (None where it is unbounded)


class DeclaresKLConstants:
    """An objective whose :class:`KLConstants` are known (the ``auto`` settings of the KL stages)."""

    def kl_constants(self) -> KLConstants:
        raise NotImplementedError


class GroupedRecords:
    """An objective with closed-form per-record losses and gradients over *distinct* records with
    multiplicities (identical records stand for each other), so a full-batch query costs the
    number of distinct records, not n, and needs no autograd."""

    def record_groups(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct records, counts) among the training indices ``indices``."""
        raise NotImplementedError

    def per_record_losses(self, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[m] losses of the distinct records ``keys`` at w."""
        raise NotImplementedError

    def per_record_grads(self, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[m, d] gradients of the distinct records ``keys`` at w."""
        raise NotImplementedError


def declared(objective, key: str, what: str) -> float:
    """The constant ``key`` of a :class:`DeclaresKLConstants` objective, for the setting ``what``
    (a recipe key) that says ``auto``."""
    consts = objective.kl_constants() if isinstance(objective, DeclaresKLConstants) else None
    value = dataclasses.asdict(consts).get(key) if consts is not None else None
    if value is None:
        raise UserError(f"auto needs an objective that declares its {key}; objective "
                        f"{objective.name!r} does not, so give a number", key=what)
    return float(value)
