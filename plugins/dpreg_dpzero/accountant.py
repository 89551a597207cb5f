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
"""

from __future__ import annotations

import math
from collections import Counter

from dpregistry import Accountant, UserError
from dpregistry.privacy.events import Composed, Gaussian, NonPrivate, PoissonSampled, PrivacyEvent, SelfComposed


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


def kov_epsilon(noise_multiplier: float, steps: float, delta: float) -> float:
    """The smallest ε that Lemma 2.2 certifies for T steps at σ/Δ = ``noise_multiplier``.

    h(ε) = m·ε − 2·sqrt(2T·log(e + ε/δ)) is convex with h(0) < 0, so it has one positive root;
    every ε at or above the root is certified. Bisection returns the upper end of the bracket.
    """
    m = noise_multiplier
    if m <= 0:
        return math.inf
    if steps == 0:
        return 0.0

    def h(eps):
        return m * eps - 2.0 * math.sqrt(2.0 * steps * log_term(eps, delta))

    lo, hi = 0.0, 1.0
    while h(hi) <= 0:
        lo, hi = hi, hi * 2
        if hi > 1e300:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if h(mid) <= 0 else (lo, mid)
    return hi


def kov_delta(noise_multiplier: float, steps: float, epsilon: float) -> float:
    """The δ at which Lemma 2.2 certifies ε: log(e + ε/δ) = (mε)²/(8T)  ⇒  δ = ε/(exp(·) − e)."""
    m = noise_multiplier
    if m <= 0:
        return 1.0
    if steps == 0:
        return 0.0
    x = (m * epsilon) ** 2 / (8.0 * steps)
    if x > 700:
        return 0.0
    excess = math.exp(x) - math.e
    return 1.0 if excess <= 0 else min(1.0, epsilon / excess)


def _flatten(ev: PrivacyEvent, n: int):
    """(Gaussian or NonPrivate, count) pairs; Poisson sampling is charged unamplified."""
    if isinstance(ev, Composed):
        for e in ev.events:
            yield from _flatten(e, n)
    elif isinstance(ev, SelfComposed):
        yield from _flatten(ev.event, n * ev.count)
    elif isinstance(ev, PoissonSampled):
        yield from _flatten(ev.event, n)
    elif isinstance(ev, (Gaussian, NonPrivate)):
        yield ev, n
    else:
        raise UserError(f"kov_advanced_composition cannot account {ev.type!r} events")


def _steps_and_multiplier(counter: Counter) -> tuple[int, float]:
    """(T, smallest σ/Δ) of a group of charges (m = 0 for a non-private release)."""
    steps, m = 0, math.inf
    for event, count in counter.items():
        for ev, n in _flatten(event, count):
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
        return all(t == 0 or m >= kov_noise_multiplier(t, b.epsilon, b.delta) for t, m in self._partitions(groups))

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
