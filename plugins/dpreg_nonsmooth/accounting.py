"""Charges whose sensitivity holds only with high probability, and the accountant that adds δ_fail.

KLT's sensitivities (spec 002 §2.2) hold on a concentration event of the mechanism's own
direction draws: with probability ≥ 1 − γ the m-direction average of a record is within r_m of
its mean. The directions are shared by neighbouring data sets, so conditioned on them holding for
the differing record of both (probability ≥ 1 − 2γ) the release is ρ-zCDP, and unconditionally
it is (ε(ρ, δ'), δ' + 2γ)-DP (spec 002 §2.5: δ_total = δ_mech + δ_fail, with δ_fail = 2γ). ``ConcentrationFailure(γ)``
records γ in the ledger next to the Gaussian/tree events it qualifies; ``zcdp_fail`` composes the
zCDP part in closed form, sums the γ's a record is exposed to (union bound) and reports ε at
δ − Σγ. Accountants that do not know this event refuse it, so a paper-mode run can never be
reported without its δ_fail. The ``safety_clip`` mode never charges it (deterministic sensitivity).
"""

from __future__ import annotations

import math
from fractions import Fraction
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from dpregistry import Accountant, StageParams, UserError
from dpregistry.privacy.accountant import _consistent, _log_ratio
from dpregistry.privacy.conversions import epsilon_to_zcdp, gaussian_zcdp, zcdp_to_delta, zcdp_to_epsilon
from dpregistry.privacy.events import Gaussian, NonPrivate, PrivacyEvent, TreeAggregation, ZCDP, leaves


@dataclass(frozen=True)
class ConcentrationFailure(PrivacyEvent):
    """The other events of this charge hold except with probability ``delta`` over the
    mechanism's own randomness (added to δ by a union bound)."""

    type: ClassVar[str] = "concentration_failure"
    delta: float

    def __post_init__(self):
        if not (0 <= self.delta < 1):
            raise ValueError(f"a failure probability must lie in [0, 1), got {self.delta}")

    def describe(self) -> str:
        return f"δ_fail({self.delta:.3g})"


def event_rho(ev: PrivacyEvent) -> float:
    """zCDP ρ of an event (Gaussian: Δ²/2σ²; tree: nodes·Δ²/2σ², spec 001 §2.3), summed over its
    compositions."""
    return sum(n * _mechanism_rho(e) for e, n in leaves(ev))


def _mechanism_rho(ev: PrivacyEvent) -> float:
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        if ev.std == 0:
            return math.inf
        try:
            return ev.sensitivity ** 2 / (2 * ev.std ** 2)
        except (OverflowError, ZeroDivisionError):  # σ² under- or overflows: the ratio does not
            return gaussian_zcdp(ev.sensitivity, ev.std)
    if isinstance(ev, ZCDP):
        return ev.rho
    if isinstance(ev, NonPrivate):
        return math.inf
    if isinstance(ev, ConcentrationFailure):
        return 0.0
    raise UserError(f"the zcdp_fail accountant cannot account {ev.type!r} events")


def event_failure(ev: PrivacyEvent) -> float:
    """The failure probability an event adds to δ (KLT's high-probability bounds), summed."""
    return sum(n * e.delta for e, n in leaves(ev) if isinstance(e, ConcentrationFailure))


class ZcdpFailParams(StageParams):
    pass


class ZcdpFailAccountant(Accountant):
    """ρ-zCDP on a high-probability event: (ρ + 2√(ρ ln 1/δ'), δ' + Σ δ_fail)-DP (KLT, spec 002 §2.5)."""

    name = "zcdp_fail"
    notion = "approx_dp"
    can_filter = False
    supports = frozenset({"gaussian", "tree_aggregation", "zcdp", "composed", "self_composed", "non_private",
                          "concentration_failure"})
    Params = ZcdpFailParams
    budgets_rho = True  # alone: a pure zCDP budget (no failure probability)

    def validate(self, ctx):
        b = self.budget
        if b.rho is not None and b.epsilon is not None:  # _fits holds one budget; the other would be ignored
            raise UserError("the zcdp_fail accountant holds one budget: privacy.epsilon and privacy.delta, or "
                            "privacy.rho alone (a zCDP budget without failure probability); not both",
                            key="privacy.rho")

    @staticmethod
    def _totals(groups, exact: bool = False) -> list[tuple[float, float]]:
        """(ρ, γ) of every partition, each including the unpartitioned charges; ``exact`` sums in
        rationals, so that a budget decision is never a rounding over the budget."""
        def num(x):  # an infinite cost stays a float (and over any budget)
            return Fraction(x) if exact and math.isfinite(x) else float(x)

        def tot(c: Counter):
            return (sum(num(n) * num(event_rho(e)) for e, n in c.items()),
                    sum(num(n) * num(event_failure(e)) for e, n in c.items()))

        base = tot(groups.get(None, Counter()))
        parts = [tot(c) for p, c in groups.items() if p is not None] or [(0.0, 0.0)]
        return [(base[0] + r, base[1] + g) for r, g in parts]

    def _epsilon(self, groups, delta):
        worst = 0.0
        for rho, gamma in self._totals(groups):
            if rho == 0:
                eps = 0.0 if gamma <= delta else math.inf
            elif gamma >= delta or math.isinf(rho):
                eps = math.inf
            else:
                eps = zcdp_to_epsilon(rho, delta - gamma)
            worst = max(worst, eps)
        return worst

    def _delta(self, groups, epsilon):
        return max(min(1.0, zcdp_to_delta(rho, epsilon) + gamma) if math.isfinite(rho) else 1.0
                   for rho, gamma in self._totals(groups))

    def _fits(self, groups):
        b = self.budget
        if b.epsilon is not None and b.delta is not None:
            return self._epsilon(groups, b.delta) <= b.epsilon
        if b.rho is not None:  # a pure zCDP budget admits no failure probability
            return all(g == 0 and r <= b.rho for r, g in self._totals(groups, exact=True))
        raise UserError("the zcdp_fail accountant needs privacy.epsilon and privacy.delta (or privacy.rho)")

    def _slack(self, groups):
        """A ρ budget's (calibration solves for its root): log(ρ / budget) of the costliest
        partition, or +inf where a failure probability is charged (no noise removes it)."""
        b = self.budget
        if b.epsilon is not None or b.rho is None:
            return super()._slack(groups)
        totals = self._totals(groups)
        if any(g > 0 for _, g in totals):
            return math.inf
        # the sign follows the exact decision (in rationals) where rounding differs
        return _consistent(_log_ratio(max(r for r, _ in totals), b.rho), self._fits(groups))

    def rho(self) -> float:
        return max(r for r, _ in self._totals(self.ledger.grouped()))

    def overspend(self, extra=()) -> str:
        b = self.budget
        if b.epsilon is not None:
            return super().overspend(extra)
        totals = self._totals(self.ledger.grouped(list(extra)))
        rho, gamma = max(r for r, _ in totals), max(g for _, g in totals)
        if rho > b.rho:
            return f"ρ = {rho:.6g}, more than the budget ρ = {b.rho:g}"
        return f"a failure probability δ_fail = {gamma:.3g}, which a zCDP budget (privacy.rho alone) does not allow"

    def delta_fail(self) -> float:
        return max(g for _, g in self._totals(self.ledger.grouped()))

    def spent(self):
        b = self.budget
        out = super().spent() if b.delta is not None else {
            "epsilon": None, "delta": None, "target_epsilon": b.epsilon, "accountant": self.name,
            "notion": self.notion, "relation": b.relation}
        out["rho"] = self.rho()
        out["delta_fail"] = gamma = self.delta_fail()
        # the ρ the budget allows once δ_fail is set aside from δ
        out["target_rho"] = b.rho if b.rho is not None else (
            epsilon_to_zcdp(b.epsilon, b.delta - gamma) if b.epsilon and b.delta and gamma < b.delta else 0.0)
        return out


ACCOUNTANTS = (ZcdpFailAccountant,)
