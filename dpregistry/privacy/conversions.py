"""Closed-form conversions between privacy notions (Bun–Steinke 2016)."""

from __future__ import annotations

import math


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """ρ-zCDP ⇒ (ρ + 2·sqrt(ρ·ln(1/δ)), δ)-DP  (Bun–Steinke 2016, Prop. 1.3)."""
    if rho < 0 or not 0 < delta < 1:
        raise ValueError("need rho >= 0 and 0 < delta < 1")
    if math.isinf(rho):
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def epsilon_to_zcdp(epsilon: float, delta: float) -> float:
    """The largest ρ whose standard conversion gives at most (ε, δ): (√(ε+L) − √L)², L = ln(1/δ)."""
    if epsilon <= 0 or not 0 < delta < 1:
        raise ValueError("need epsilon > 0 and 0 < delta < 1")
    if math.isinf(epsilon):
        return math.inf
    L = math.log(1.0 / delta)
    rho = (epsilon / (math.sqrt(epsilon + L) + math.sqrt(L))) ** 2  # = (√(ε+L) − √L)², without cancellation
    while zcdp_to_epsilon(rho, delta) > epsilon:  # rounding must not raise the ε it converts back to
        rho = math.nextafter(rho, 0.0)
    return rho


def zcdp_to_delta(rho: float, epsilon: float) -> float:
    """Smallest δ with ρ + 2·sqrt(ρ ln(1/δ)) <= ε under the standard bound (1 if none)."""
    if rho == 0:
        return 0.0
    if epsilon <= rho:
        return 1.0
    return min(1.0, math.exp(-((epsilon - rho) ** 2) / (4.0 * rho)))


def gaussian_zcdp(sensitivity: float, std: float) -> float:
    """The Gaussian mechanism is Δ²/(2σ²)-zCDP (as (Δ/σ)²/2: no overflow for a huge σ; inf for a
    σ so small that (Δ/σ)² overflows)."""
    if std == 0:
        return math.inf
    try:
        return (sensitivity / std) ** 2 / 2
    except OverflowError:
        return math.inf
