"""Parameter settings of Kornowski–Liu–Talwar (Theorems 3.1, 4.1, 6.1), with spec 002's corrections.

The theorems state Θ̃/Õ settings; every hidden constant is 1 here ([AMBIG-15]) and can be
overridden by giving the stage parameter explicitly. Logs: log2 for the tree depth, ln for δ
([AMBIG-6]).
"""

from __future__ import annotations

import math

from dpregistry.privacy.conversions import epsilon_to_zcdp
from dpregistry.privacy.events import tree_nodes_per_record as nodes_per_record


def theory_radius(init_gap: float, alpha: float, lipschitz: float, T: int, dim: int, epsilon: float) -> float:
    """D of Thm 3.1/6.1: min of the four terms (the first is redundant, [AMBIG-10], kept as printed)."""
    P, a, L, d, e = init_gap, alpha, lipschitz, dim, epsilon
    terms = [(P * P * a / (L * L * T * T)) ** (1 / 3),
             (P * a * e / (d * L * T)) ** 0.5 if math.isfinite(e) else math.inf,
             (P ** 3 * a * a * e / (d ** 1.5 * L ** 3 * T ** 3)) ** 0.2 if math.isfinite(e) else math.inf,
             (P * P * a / (L * L * T * T * math.sqrt(d))) ** (1 / 3)]
    return min(terms)


def theory_period(alpha: float, epsilon: float, radius: float, dim: int) -> int:
    """Σ = (α/(εD))^{2/3} + α/(D√d) (Thm 3.1/6.1), rounded up."""
    priv = (alpha / (epsilon * radius)) ** (2 / 3) if math.isfinite(epsilon) else 0.0
    return max(1, math.ceil(priv + alpha / (radius * math.sqrt(dim))))


def theory_window(alpha: float, radius: float) -> int:
    """M = α/(4D), floored and at least 1 (so that M·D ≤ α, [AMBIG-13])."""
    return max(1, math.floor(alpha / (4 * radius)))


def theory_dirs_zo(dim: int, alpha: float, radius: float, gamma: float) -> int:
    """m making the concentration term no larger than the deterministic one (coupled randomness,
    spec 002 §2.2 [IMPL]): fresh r_m ≤ L and VR 2r_m ≤ 2L√dD/α, with r_m = L(d+1)·sqrt(2 ln(2/γ')/m)."""
    d = dim
    fresh = 2 * math.log(2 / gamma) * (d + 1) ** 2
    vr = 2 * math.log(4 / gamma) * (d + 1) ** 2 * alpha ** 2 / (d * radius ** 2)
    return math.ceil(max(fresh, vr))


def theory_dirs_fo(dim: int, alpha: float, radius: float, gamma: float) -> int:
    """m of Thm 6.1 in the same sense: 2r_m ≤ 2L√dD/α with r_m = 2L·sqrt(2 ln(4/γ)/m) (Ω̃(d²) below ZO)."""
    return math.ceil(2 * math.log(4 / gamma) * 4 * alpha ** 2 / (dim * radius ** 2))


def prop25_sigma(s: float, period: int, epsilon: float, delta: float, log: str = "log2") -> float:
    """Prop. 2.5: σ = 4s·sqrt(log Σ · ln(1/δ))/ε (log2 by default; ``ln`` for comparison)."""
    depth = math.log2(period) if log == "log2" else math.log(period)
    return 4 * s * math.sqrt(depth * math.log(1 / delta)) / epsilon


def exact_tree_sigma(s: float, period: int, epsilon: float, delta: float) -> float:
    """Exact alternative (spec 002 §2.3 [IMPL]): a record touches ⌊log2 Σ⌋+1 released nodes, so a
    period is a Gaussian mechanism of sensitivity s·sqrt(⌊log2 Σ⌋+1); σ for its ρ-zCDP budget."""
    rho = epsilon_to_zcdp(epsilon, delta)
    return s * math.sqrt(nodes_per_record(period) / (2 * rho))


def erm_settings(init_gap: float, alpha: float, lipschitz: float, beta: float, dim: int,
                 rule: str = "balanced") -> tuple[float, int, int]:
    """(D, T, Σ) of Thm 4.1. [AMBIG-9]: the printed D = α²β²/L², T = ΦL²/(α²β³) are dimensionally
    off; the balanced D = αβ²/L², T = ΦL²/(αβ³) keep D·T = Φ/β (default). Σ = α/(D√d)."""
    a, b, L, P = alpha, beta, lipschitz, init_gap
    if rule == "balanced":
        D, T = a * b * b / (L * L), P * L * L / (a * b ** 3)
    elif rule == "printed":
        D, T = a * a * b * b / (L * L), P * L * L / (a * a * b ** 3)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    return D, max(1, math.ceil(T)), max(1, math.ceil(a / (D * math.sqrt(dim))))
