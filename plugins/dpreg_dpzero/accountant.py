"""Lemma 2.2 of DPZero as an accountant: the closed form of advanced composition (KOV).

Lemma 2.2 (DPZero spec §4.1; Kairouz–Oh–Viswanath 2015 Thm 4.3, extended to vectors by
Kenthapadi et al.): T adaptively composed Gaussian mechanisms N(0, σ²I) on a statistic of L2
sensitivity Δ are (ε, δ)-DP for any ε > 0 and δ ∈ (0, 1) when

    σ / Δ = 2·sqrt(2T·log(e + ε/δ)) / ε            (natural log; σ is a standard deviation)

With the clipped mean of full-batch DPZero, Δ = 2C/n (replace-one), which gives the paper's
σ = 4C·sqrt(2T·log(e + ε/δ))/(nε) (spec §2.1, errata 1). The accountant reads Δ from each event
(``Gaussian.sensitivity`` already holds the relation's factor), so it is the same for Alg. 1 and 2
and does not depend on d or on the direction distribution (spec §7 coupling 8, §8 I).

Events it composes: Gaussian mechanisms, also inside Poisson sampling, which it charges *without*
amplification (the sampled mechanism is a mixture of neighbouring pairs of the unsampled one, so
its (ε₀, δ₀) holds for every step; valid and conservative — spec §7 coupling 7). Steps with
different noise are all charged at the smallest multiplier (a Gaussian with more noise is
post-processing of one with less), so the bound stays valid for mixed plans. It is not a privacy
filter: advanced composition with adaptively chosen parameters needs other bounds.

Lemma 2.2 as printed ("for any ε > 0") is false for large ε: its σ/Δ makes T steps exactly
μ-GDP with μ = ε/(2·sqrt(2·log(e + ε/δ))), which grows linearly in ε, so e.g. at ε = 300,
δ = 1e-5 the true δ is 0.84 (dp-accounting's tight PLD agrees). The accountant therefore never
certifies more than the exact composition of the same Gaussians allows (μ = sqrt(T)/m, Dong–Roth–Su;
δ(ε) of Balle–Wang): wherever the Lemma holds (every setting of the paper) nothing changes.
"""

from __future__ import annotations

import math
from collections import Counter

from dpregistry import Accountant, UserError
from dpregistry.privacy.events import Gaussian, NonPrivate, PoissonSampled, PrivacyEvent, leaves


def log_term(epsilon: float, delta: float) -> float:
    """log(e + ε/δ), the LG of the spec (natural log)."""
    return math.log(math.e + epsilon / delta)


def kov_noise_multiplier(steps: float, epsilon: float, delta: float) -> float:
    """σ/Δ of Lemma 2.2: 2·sqrt(2T·log(e + ε/δ))/ε."""
    if not (epsilon > 0 and 0 < delta < 1 and steps > 0):
        raise ValueError("need epsilon > 0, 0 < delta < 1 and steps > 0")
    return 2.0 * math.sqrt(2.0 * steps * log_term(epsilon, delta)) / epsilon


def kov_sigma(clip: float, n: int, steps: float, epsilon: float, delta: float) -> float:
    """Std of the noise on the full-batch clipped mean: Δ = 2C/n (replace-one), spec §2.1."""
    return (2.0 * clip / n) * kov_noise_multiplier(steps, epsilon, delta)


def gaussian_composition_delta(noise_multiplier: float, steps: float, epsilon: float) -> float:
    """The exact δ(ε) of T composed Gaussian mechanisms at σ/Δ = m: μ-GDP with μ = sqrt(T)/m
    (Dong, Roth & Su 2019, adaptive composition), δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)
    (Balle & Wang 2018). Used only to keep Lemma 2.2 from certifying where it is false."""
    from scipy.special import log_ndtr, ndtr

    if steps == 0:
        return 0.0
    if noise_multiplier <= 0:
        return 1.0
    mu = math.sqrt(steps) / noise_multiplier
    a, b = -epsilon / mu + mu / 2, -epsilon / mu - mu / 2
    second = math.exp(min(epsilon + float(log_ndtr(b)), 700.0))
    return min(1.0, max(0.0, float(ndtr(a)) - second))


def _smallest_certified(certified, start: float = 1.0) -> float:
    """The smallest ε ≥ 0 with ``certified(ε)`` for a monotone test (bisection; the upper end)."""
    lo, hi = 0.0, start
    while not certified(hi):
        lo, hi = hi, hi * 2
        if hi > 1e300:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if not certified(mid) else (lo, mid)
    return hi


def kov_epsilon(noise_multiplier: float, steps: float, delta: float) -> float:
    """The smallest ε that Lemma 2.2 certifies for T steps at σ/Δ = ``noise_multiplier``, and
    that the exact Gaussian composition confirms (see the module docstring).

    h(ε) = m·ε − 2·sqrt(2T·log(e + ε/δ)) is convex with h(0) < 0, so it has one positive root;
    every ε at or above the root passes the Lemma. The exact δ(ε) decreases in ε, so the set of
    confirmed ε is an interval [ε*, ∞) too: the answer is the larger of the two left ends.
    """
    m = noise_multiplier
    if m <= 0:
        return math.inf
    if steps == 0:
        return 0.0

    def h(eps):
        return m * eps - 2.0 * math.sqrt(2.0 * steps * log_term(eps, delta))

    lemma = _smallest_certified(lambda eps: h(eps) >= 0)  # the Lemma certifies σ at its bound
    exact = _smallest_certified(lambda eps: gaussian_composition_delta(m, steps, eps) <= delta)
    return max(lemma, exact)


def kov_delta(noise_multiplier: float, steps: float, epsilon: float) -> float:
    """The δ at which Lemma 2.2 certifies ε: log(e + ε/δ) = (mε)²/(8T)  ⇒  δ = ε/(exp(·) − e);
    never below the exact δ(ε) of the same Gaussians (see the module docstring)."""
    m = noise_multiplier
    if m <= 0:
        return 1.0
    if steps == 0:
        return 0.0
    exact = gaussian_composition_delta(m, steps, epsilon)
    x = (m * epsilon) ** 2 / (8.0 * steps)
    if x > 700:
        return exact
    excess = math.exp(x) - math.e
    return 1.0 if excess <= 0 else max(exact, min(1.0, epsilon / excess))


def _mechanisms(event: PrivacyEvent, count: int):
    """(Gaussian or NonPrivate, count) pairs; Poisson sampling is charged unamplified."""
    for ev, n in leaves(event, count, unwrap=(PoissonSampled,)):
        if not isinstance(ev, (Gaussian, NonPrivate)):
            raise UserError(f"kov_advanced_composition cannot account {ev.type!r} events")
        yield ev, n


def _steps_and_multiplier(counter: Counter) -> tuple[int, float]:
    """(T, smallest σ/Δ) of a group of charges (m = 0 for a non-private release)."""
    steps, m = 0, math.inf
    for event, count in counter.items():
        for ev, n in _mechanisms(event, count):
            if n == 0:
                continue
            steps += n
            m = min(m, 0.0 if isinstance(ev, NonPrivate) or ev.std == 0 else ev.noise_multiplier)
    return steps, m


class KovAdvancedComposition(Accountant):
    """DPZero's Lemma 2.2 closed form (advanced composition, no amplification); (ε, δ)-DP."""

    name = "kov_advanced_composition"
    notion = "approx_dp"
    can_filter = False
    supports = frozenset({"gaussian", "poisson_sampled", "composed", "self_composed", "non_private"})

    def _partitions(self, groups):
        base = groups.get(None, Counter())
        parts = [c for p, c in groups.items() if p is not None] or [Counter()]
        return [_steps_and_multiplier(base + c) for c in parts]

    def _epsilon(self, groups, delta):
        return max(kov_epsilon(m, t, delta) if t else 0.0 for t, m in self._partitions(groups))

    def _delta(self, groups, epsilon):
        return max(kov_delta(m, t, epsilon) if t else 0.0 for t, m in self._partitions(groups))

    def _fits(self, groups):
        # Exact monotone test, no root finding: m >= 2·sqrt(2T·log(e+ε/δ))/ε.
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError("kov_advanced_composition needs privacy.epsilon and privacy.delta")
        return all(t == 0 or (m >= kov_noise_multiplier(t, b.epsilon, b.delta)
                              and gaussian_composition_delta(m, t, b.epsilon) <= b.delta)
                   for t, m in self._partitions(groups))

    def calibrate(self, plan, **kw):
        """The closed form: z such that the smallest σ/Δ of the plan equals Lemma 2.2's.

        Privatizers scale the std linearly in z, so σ/Δ(z) = z·σ/Δ(1); the answer is checked
        against the plan (and nudged up by ulps if rounding left it a hair short).
        """
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError("kov_advanced_composition needs privacy.epsilon and privacy.delta")
        parts = self._partitions(self.ledger.grouped(plan(1.0)))
        t = max(t for t, _ in parts)
        m1 = min(m for t_, m in parts if t_)
        if not (t and math.isfinite(m1) and m1 > 0):
            return super().calibrate(plan, **kw)
        z = max(kov_noise_multiplier(tp, b.epsilon, b.delta) / m for tp, m in parts if tp)
        for _ in range(64):
            if self.fits(plan(z)):
                return z
            z = math.nextafter(z, math.inf)
        return super().calibrate(plan, **kw)  # the plan is not linear in z
