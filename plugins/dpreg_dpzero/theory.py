"""Parameter choices of DPZero's Theorems 1–3 (spec §3.2–3.4), for recipes and checks.

Every calculator takes (n, d, r, ε, δ, L, ℓ) and returns the step size α, the number of steps T
(real-valued, as in the theorems), the clip C, the largest admissible smoothing λ, and the
Lemma 2.2 noise std σ(C, T) on the full-batch mean. ``LG = log(e + ε/δ)`` (natural log).

* Theorem 1 (DPGD-0th, Alg. 1, A3.1): α = 1/(4ℓd), T = nε/sqrt(d·LG), C = L·d,
  λ ≤ (4L/(ℓd))·(sqrt(d·LG)/(nε))^{1/2}.
* Theorem 2 (DPGD-0th, A3.5 with effective rank r): α = 1/(4ℓ(r+2)),
  T = n(r+2)ε/(d·sqrt(r·LG)), C = L·d, λ ≤ (4L/(ℓd))·(sqrt(r·LG)/(nε))^{1/2}.
* Theorem 3 (DPZero, Alg. 2, A3.5): L̃² = L²·log(2√(2π)·d(r+2)n³ε²/(r·LG)), C = 4L̃,
  α = 1/(4ℓ(r+2)), T = n(r+2)ε/(4·sqrt(r·LG)),
  λ ≤ (1/(ℓd))·min{4(2−√2)·L̃, (L/√d)·(sqrt(r·LG)/(nε))^{1/2}}.
  (Errata 8: Corollary F.4 defines L̃ differently; this is Theorem 3's.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .accountant import kov_sigma, log_term


@dataclass(frozen=True)
class TheoremParams:
    theorem: int
    alpha: float
    steps: float
    clip: float
    lambda_max: float
    sigma: float            # Lemma 2.2 std on the full-batch clipped mean at (clip, steps)
    L_tilde: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _check(n, d, r, epsilon, delta, L, ell):
    if not (n > 0 and d > 0 and epsilon > 0 and 0 < delta < 1 and L > 0 and ell > 0):
        raise ValueError("need n, d, ε, L, ℓ > 0 and 0 < δ < 1")
    if r is not None and not 0 < r <= d:
        raise ValueError("the effective rank r must lie in (0, d]")


def params_theorem1(n: int, d: int, r: float | None = None, epsilon: float = 2.0, delta: float = 1e-6,
                    L: float = 1.0, ell: float = 1.0) -> TheoremParams:
    """Theorem 1 (DPGD-0th without the low-rank assumption; r is ignored)."""
    _check(n, d, r, epsilon, delta, L, ell)
    lg = log_term(epsilon, delta)
    steps = n * epsilon / math.sqrt(d * lg)
    clip = L * d
    lam = (4 * L / (ell * d)) * math.sqrt(math.sqrt(d * lg) / (n * epsilon))
    return TheoremParams(1, 1 / (4 * ell * d), steps, clip, lam, kov_sigma(clip, n, steps, epsilon, delta))


def params_theorem2(n: int, d: int, r: float, epsilon: float = 2.0, delta: float = 1e-6,
                    L: float = 1.0, ell: float = 1.0) -> TheoremParams:
    """Theorem 2 (DPGD-0th under A3.5)."""
    _check(n, d, r, epsilon, delta, L, ell)
    lg = log_term(epsilon, delta)
    steps = n * (r + 2) * epsilon / (d * math.sqrt(r * lg))
    clip = L * d
    lam = (4 * L / (ell * d)) * math.sqrt(math.sqrt(r * lg) / (n * epsilon))
    return TheoremParams(2, 1 / (4 * ell * (r + 2)), steps, clip, lam, kov_sigma(clip, n, steps, epsilon, delta))


def params_theorem3(n: int, d: int, r: float, epsilon: float = 2.0, delta: float = 1e-6,
                    L: float = 1.0, ell: float = 1.0) -> TheoremParams:
    """Theorem 3 (DPZero under A3.5): the main result."""
    _check(n, d, r, epsilon, delta, L, ell)
    lg = log_term(epsilon, delta)
    L_tilde = L * math.sqrt(math.log(2 * math.sqrt(2 * math.pi) * d * (r + 2) * n ** 3 * epsilon ** 2 / (r * lg)))
    clip = 4 * L_tilde
    steps = n * (r + 2) * epsilon / (4 * math.sqrt(r * lg))
    lam = (1 / (ell * d)) * min(4 * (2 - math.sqrt(2)) * L_tilde,
                                (L / math.sqrt(d)) * math.sqrt(math.sqrt(r * lg) / (n * epsilon)))
    return TheoremParams(3, 1 / (4 * ell * (r + 2)), steps, clip, lam, kov_sigma(clip, n, steps, epsilon, delta),
                         L_tilde)
