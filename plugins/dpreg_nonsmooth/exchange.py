"""What the O2NC stages hand each other: the typed values of ``needs``/``provides`` (dpregistry.context).

Who provides what, and who reads it::

    Smoothing      estimator (zo_sphere, fo_ball, ...)  ->  O2NC algorithm      (recipe values, before setup)
    O2NCSchedule   O2NC algorithm                       ->  single_pass sampler, the oracles, the stream
                                                            privatizers, the o2nc update rule
    OracleBounds   estimator                            ->  stream privatizers (sensitivity), algorithm (η)
    GradientBound  O2NC algorithm                       ->  o2nc update rule (η = D/(G·sqrt(H)))

The algorithm resolves the schedule in its ``setup``, which the run calls before the other stages'
(``dpregistry.run``), so the stages read it in their own ``setup``; the oracles' bounds exist once
the estimator is set up, so their readers take them in ``validate``; the gradient bound depends on
the calibrated noise and is computed when the update rule first asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .tree import period_position


@dataclass(frozen=True)
class O2NCSchedule:
    """Every number the stages of one O2NC run share, resolved before step 1 (each paper fills in
    its theorem's values where a recipe says ``auto``), and the period clock."""

    dim: int
    n: int
    period: int                  # VR / tree period Σ (ZTC: the episode length T)
    batch_first: int             # B1, at p = 1
    batch_rest: int              # B2, at p > 1
    radius: float                # D: ‖Δ‖ ≤ D, so ‖w_t − w_{t−1}‖ ≤ 2D
    window: int                  # averaging window of the output (ZTC: T; KLT: M)
    restart_every: int | None    # steps between restarts of the online learner (ZTC: T; KLT: never)
    total_steps: int
    single_pass: bool            # every record in at most one step (parallel composition)
    smooth_radius: float         # δ (ZTC) / α (KLT)
    lipschitz: float             # L
    dirs: int | None = None      # m resolved from "theory" (None: the estimator's own integer)
    delta_fail: float = 0.0      # per-use failure probability γ of high-probability bounds ("auto")
    extra: dict[str, Any] = field(default_factory=dict)

    def position(self, step: int) -> tuple[int, int]:
        """(period index k ≥ 0, position p ∈ {1..Σ}) of 0-based global step ``step``."""
        return step // self.period, period_position(step + 1, self.period)


@dataclass(frozen=True)
class Smoothing:
    """What a nonsmooth oracle declares to the O2NC algorithm, from its recipe section: the radius
    of the smoothed loss f_δ(x) = E f(x + δv) (δ in ZTC, α in KLT) and the Lipschitz constant L its
    bounds rest on (the theorems' settings need both), and the choices it leaves to the theorem."""

    radius: float
    lipschitz: float
    delta_fail: float | Literal["auto"] = 0.0  # γ; auto: the algorithm's share of δ
    theory_dirs: bool = False                  # dirs_per_sample: theory (the theorem's m)


@dataclass(frozen=True)
class OracleBounds:
    """Public bounds on an oracle's per-example contributions, at the schedule's D and m.

    ``(R, γ)``: every contribution has norm ≤ R except with probability γ over the oracle's own
    directions (γ = 0 when the bound is worst case or enforced by clipping). The privatizer's
    sensitivity is 2R/B; the variances set the step size only."""

    fresh: tuple[float, float]                # a fresh estimate (p = 1)
    increment: tuple[float, float] | None     # an increment at the worst gap 2D; None: no increments
    fresh_variance: float                     # E‖c − E c‖² of a fresh estimate
    increment_variance: float = 0.0           # of an increment at the gap 2D


@dataclass(frozen=True)
class GradientBound:
    """A-priori bound G on sqrt(E‖g̃_t‖²), for the step size η = D/(G·sqrt(H)) (spec 001 §3.5,
    spec 002 Eq. 7). It includes the privatizer's noise, so it exists once the noise is calibrated."""

    value: float
