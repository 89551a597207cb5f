"""RDP, PLD and zCDP accountants, and the Rényi/zCDP privacy filters.

Every curve and every PLD comes from Google's ``dp-accounting``; this module only maps
dpregistry's events onto its DpEvents, with the sensitivity convention of
:mod:`dpregistry.privacy.events` (``Gaussian.sensitivity`` is the L2 distance between
neighbouring outputs). The mapping per relation is:

* plain Gaussian: noise multiplier std/Δ; the curve does not depend on the relation.
* Poisson, add/remove: dp-accounting's add/remove analysis with multiplier std/Δ (Δ = C).
* Poisson, replace-one: PLD uses dp-accounting's tight REPLACE_ONE analysis (per-record bound
  Δ/2). RDP has no replace-one Poisson analysis; it uses add/remove at the doubled sensitivity
  Δ = 2C (multiplier std/2C), which upper-bounds the tight replace-one curve (tested against the
  PLD). This is also the convention of the DPZero code (std = 2·m·C/B, DPZero spec §4.2).
* sampling without replacement (replace-one): RDP of Wang–Balle–Kasiviswanathan 2019 via
  dp-accounting. PLD has no such analysis and refuses it.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from functools import lru_cache

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.rdp import rdp_privacy_accountant as rdplib
from pydantic import Field

from dpregistry.errors import UserError
from dpregistry.privacy.accountant import Accountant
from dpregistry.privacy.conversions import epsilon_to_zcdp, zcdp_to_delta, zcdp_to_epsilon
from dpregistry.privacy.events import (Composed, Exponential, Gaussian, NonPrivate, PoissonSampled,
                                       PrivacyEvent, SampledWithoutReplacement, SelfComposed,
                                       TreeAggregation, ZCDP)
from dpregistry.stages import StageParams

# dp-accounting warns (through absl) about fractional orders it drops; the result stays valid.
logging.getLogger("absl").setLevel(logging.ERROR)

NR = dpa.NeighboringRelation
ORDERS = tuple(rdplib.DEFAULT_RDP_ORDERS)


def _gaussian_multiplier(ev: PrivacyEvent) -> float:
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if not isinstance(ev, Gaussian):
        raise UserError(f"only Gaussian mechanisms can be subsampled, got {ev.type!r}")
    return ev.noise_multiplier


# ------------------------------------------------------------------------------------------
# RDP
# ------------------------------------------------------------------------------------------


def _to_rdp_event(ev: PrivacyEvent, relation: str):
    """(dp-accounting event, dp-accounting relation) for the RDP accountant."""
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        return (dpa.GaussianDpEvent(ev.noise_multiplier) if ev.std > 0 else dpa.NonPrivateDpEvent()), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, PoissonSampled):
        z = _gaussian_multiplier(ev.event)
        inner = dpa.GaussianDpEvent(z) if z > 0 else dpa.NonPrivateDpEvent()
        return dpa.PoissonSampledDpEvent(ev.q, inner), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, SampledWithoutReplacement):
        if relation != "replace_one":
            raise UserError("sampling without replacement is analysed under replace-one only")
        z = _gaussian_multiplier(ev.event)
        return dpa.SampledWithoutReplacementDpEvent(ev.n, ev.batch_size, dpa.GaussianDpEvent(z)), NR.REPLACE_ONE
    if isinstance(ev, ZCDP):
        return dpa.ZCDpEvent(ev.rho), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, Exponential):
        return dpa.ZCDpEvent(ev.zcdp_rho()), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, NonPrivate):
        return dpa.NonPrivateDpEvent(), NR.ADD_OR_REMOVE_ONE
    raise UserError(f"the rdp accountant cannot account {ev.type!r} events")


@lru_cache(maxsize=4096)
def rdp_curve(ev: PrivacyEvent, relation: str, orders: tuple = ORDERS) -> np.ndarray:
    """RDP curve of one event (composition adds curves, so counts multiply it)."""
    if isinstance(ev, Composed):
        return sum((rdp_curve(e, relation, orders) for e in ev.events), np.zeros(len(orders)))
    if isinstance(ev, SelfComposed):
        return ev.count * rdp_curve(ev.event, relation, orders)
    dp_event, nr = _to_rdp_event(ev, relation)
    acc = dpa.rdp.RdpAccountant(list(orders), nr)
    acc.compose(dp_event)
    return np.array(acc.rdp, dtype=float)


class RdpParams(StageParams):
    orders: list[float] | None = Field(default=None, description="RDP orders (default: dp-accounting's)")


class RdpAccountant(Accountant):
    """Rényi DP via dp-accounting (Mironov 2017; Poisson-subsampled Gaussian of Mironov et al. 2019)."""

    name = "rdp"
    notion = "rdp"
    can_filter = False  # choosing the best order after the fact is not a valid filter
    supports = frozenset({"gaussian", "poisson_sampled", "sampled_without_replacement", "composed",
                          "self_composed", "zcdp", "tree_aggregation", "exponential", "non_private"})
    Params = RdpParams

    @property
    def orders(self) -> tuple:
        return tuple(self.cfg.orders) if self.cfg.orders else ORDERS

    def curve(self, groups) -> np.ndarray:
        """Σ unpartitioned curves + order-wise max over partitions (each record is in one)."""
        rel, orders = self.budget.relation, self.orders
        part = {p: sum((n * rdp_curve(k, rel, orders) for k, n in c.items()), np.zeros(len(orders)))
                for p, c in groups.items()}
        base = part.pop(None, np.zeros(len(orders)))
        worst = np.max(np.stack(list(part.values())), axis=0) if part else 0.0
        return base + worst

    def _epsilon(self, groups, delta):
        eps, _ = rdplib.compute_epsilon(self.orders, self.curve(groups), delta)
        return float(eps)

    def _delta(self, groups, epsilon):
        d, _ = rdplib.compute_delta(self.orders, self.curve(groups), epsilon)
        return float(d)


class RdpFilterParams(RdpParams):
    order: float | None = Field(default=None, gt=1, description="the fixed Rényi order of the filter")


class RdpFilter(RdpAccountant):
    """Rényi privacy filter at one fixed order (Feldman–Zrnic 2021): valid for adaptive costs."""

    name = "rdp_filter"
    can_filter = True
    Params = RdpFilterParams

    def _order_budget(self, order: float) -> float:
        """Largest RDP value at ``order`` whose conversion gives at most the target ε at δ."""
        b = self.budget
        lo, hi = 0.0, b.epsilon
        for _ in range(100):
            mid = (lo + hi) / 2
            if rdplib.compute_epsilon([order], [mid], b.delta)[0] <= b.epsilon:
                lo = mid
            else:
                hi = mid
        return lo

    @property
    def order(self) -> float:
        if self.cfg.order is not None:
            return self.cfg.order
        # The order that allows the most Gaussian-like (linear-in-α) spend: max B(α)/α.
        cands = [a for a in ORDERS if a > 1.01]
        return max(cands, key=lambda a: self._order_budget(a) / a)

    def _fits(self, groups):
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError("rdp_filter needs privacy.epsilon and privacy.delta")
        a = self.order
        c = self.curve_at(groups, a)
        return c <= self._order_budget(a)

    def curve_at(self, groups, order: float) -> float:
        rel = self.budget.relation
        part = {p: sum(n * rdp_curve(k, rel, (order,))[0] for k, n in c.items()) for p, c in groups.items()}
        base = part.pop(None, 0.0)
        return base + (max(part.values()) if part else 0.0)

    def _epsilon(self, groups, delta):
        # The filter's guarantee is stated at its fixed order.
        a = self.order
        return float(rdplib.compute_epsilon([a], [self.curve_at(groups, a)], delta)[0])


# ------------------------------------------------------------------------------------------
# PLD
# ------------------------------------------------------------------------------------------


def pld_of(ev: PrivacyEvent, relation: str, discretization: float):
    """dp-accounting PLD of one event (None for a no-op)."""
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        if ev.std == 0:
            return math.inf
        return pldlib.from_gaussian_mechanism(ev.std, sensitivity=ev.sensitivity,
                                              value_discretization_interval=discretization)
    if isinstance(ev, PoissonSampled):
        inner = ev.event.as_gaussian() if isinstance(ev.event, TreeAggregation) else ev.event
        if not isinstance(inner, Gaussian):
            raise UserError("pld: only Poisson-subsampled Gaussians are supported")
        if inner.std == 0:
            return math.inf
        if relation == "replace_one":
            # per-record bound = Δ/2: the differing record moves the sum by ±Δ/2 from the rest
            return pldlib.from_gaussian_mechanism(inner.std, sensitivity=inner.sensitivity / 2,
                                                  sampling_prob=ev.q, neighboring_relation=NR.REPLACE_ONE,
                                                  value_discretization_interval=discretization)
        return pldlib.from_gaussian_mechanism(inner.std, sensitivity=inner.sensitivity, sampling_prob=ev.q,
                                              neighboring_relation=NR.ADD_OR_REMOVE_ONE,
                                              value_discretization_interval=discretization)
    if isinstance(ev, NonPrivate):
        return math.inf
    raise UserError(f"the pld accountant cannot account {ev.type!r} events (use rdp or zcdp)")


class PldParams(StageParams):
    discretization: float = Field(default=1e-4, gt=0, description="PLD value discretization interval")


class PldAccountant(Accountant):
    """Privacy loss distributions via dp-accounting (tight (ε, δ); not a valid adaptive filter)."""

    name = "pld"
    notion = "approx_dp"
    can_filter = False
    supports = frozenset({"gaussian", "poisson_sampled", "composed", "self_composed", "tree_aggregation",
                          "non_private"})
    Params = PldParams

    def _compose(self, counter: Counter, discretization: float):
        total = None
        for event, n in counter.items():
            for ev, m in _flatten(event, n):
                p = pld_of(ev, self.budget.relation, discretization)
                if p is math.inf:
                    return math.inf
                p = p.self_compose(m) if m > 1 else p
                total = p if total is None else total.compose(p)
        return total

    def _per_partition(self, groups, discretization=None):
        d = discretization or self.cfg.discretization
        base = groups.get(None, Counter())
        parts = [c for p, c in groups.items() if p is not None] or [Counter()]
        return [self._compose(base + c, d) for c in parts]

    def _epsilon(self, groups, delta, discretization=None):
        vals = []
        for pld in self._per_partition(groups, discretization):
            vals.append(math.inf if pld is math.inf else (0.0 if pld is None else pld.get_epsilon_for_delta(delta)))
        return max(vals)

    def _fits_at(self, plan, z: float, discretization: float) -> bool:
        b = self.budget
        return self._epsilon(self.ledger.grouped(plan(z)), b.delta, discretization) <= b.epsilon

    def calibrate(self, plan, *, rtol: float = 1e-4, **_):
        """Coarse-to-fine bisection, warm-started by RDP.

        RDP's (ε, δ) bound is looser than the PLD's, so the RDP-calibrated multiplier fits and is the
        upper end of the bracket. A coarse PLD (pessimistic, so its ε still upper-bounds the truth)
        narrows the bracket; the configured discretization finishes it. Every answer fits the
        budget at the configured discretization.
        """
        rdp = RdpAccountant()
        rdp.bind(self.budget)
        rdp.ledger = self.ledger
        fine = self.cfg.discretization
        coarse = max(fine, 1e-3)
        hi = rdp.calibrate(plan, rtol=1e-3)
        while not self._fits_at(plan, hi, fine):
            hi *= 1.5
        lo = hi / 2
        for _ in range(8):
            if not self._fits_at(plan, lo, coarse):
                break
            hi, lo = lo, lo / 2
        while hi / lo > 1 + 1e-3:  # coarse bisection: a bracket [lo, hi] with hi fitting
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self._fits_at(plan, mid, coarse) else (mid, hi)
        lo = min(lo, hi * (1 - 5e-3))  # the fine boundary lies at or below the coarse one
        while self._fits_at(plan, lo, fine):
            hi, lo = lo, lo * (1 - 5e-3)
        while hi / lo > 1 + rtol:
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if self._fits_at(plan, mid, fine) else (mid, hi)
        return hi

    def _delta(self, groups, epsilon):
        vals = []
        for pld in self._per_partition(groups):
            vals.append(1.0 if pld is math.inf else (0.0 if pld is None else pld.get_delta_for_epsilon(epsilon)))
        return max(vals)


def _flatten(ev: PrivacyEvent, n: int):
    """Expand composed/self-composed events into (base event, count) pairs."""
    if isinstance(ev, Composed):
        for e in ev.events:
            yield from _flatten(e, n)
    elif isinstance(ev, SelfComposed):
        yield from _flatten(ev.event, n * ev.count)
    else:
        yield ev, n


# ------------------------------------------------------------------------------------------
# zCDP
# ------------------------------------------------------------------------------------------


def zcdp_rho(ev: PrivacyEvent) -> float:
    """ρ of one event. Subsampling is not amplified in zCDP (a valid, conservative charge)."""
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        return math.inf if ev.std == 0 else ev.sensitivity ** 2 / (2 * ev.std ** 2)
    if isinstance(ev, (PoissonSampled, SampledWithoutReplacement)):
        return zcdp_rho(ev.event)
    if isinstance(ev, ZCDP):
        return ev.rho
    if isinstance(ev, Exponential):
        return ev.zcdp_rho()
    if isinstance(ev, Composed):
        return sum(zcdp_rho(e) for e in ev.events)
    if isinstance(ev, SelfComposed):
        return ev.count * zcdp_rho(ev.event)
    if isinstance(ev, NonPrivate):
        return math.inf
    raise UserError(f"the zcdp accountant cannot account {ev.type!r} events")


class ZcdpParams(StageParams):
    conversion: str = Field(default="standard", pattern="^(standard|tight)$",
                            description="ρ→(ε,δ): Bun–Steinke's bound or dp-accounting's numerical RDP conversion")


class ZcdpAccountant(Accountant):
    """Closed-form ρ-zCDP (Bun–Steinke); composition adds ρ. A valid privacy filter."""

    name = "zcdp"
    notion = "zcdp"
    can_filter = True
    supports = RdpAccountant.supports
    Params = ZcdpParams

    def rho_of(self, groups) -> float:
        part = {p: sum(n * zcdp_rho(e) for e, n in c.items()) for p, c in groups.items()}
        base = part.pop(None, 0.0)
        return base + (max(part.values()) if part else 0.0)

    def rho(self) -> float:
        return self.rho_of(self.ledger.grouped())

    def budget_rho(self) -> float:
        b = self.budget
        if b.rho is not None:
            return b.rho
        if b.epsilon is None or b.delta is None:
            raise UserError("the zcdp accountant needs privacy.rho, or privacy.epsilon and privacy.delta")
        return epsilon_to_zcdp(b.epsilon, b.delta)

    def _fits(self, groups):
        return self.rho_of(groups) <= self.budget_rho() * (1 + 1e-12)

    def _epsilon(self, groups, delta):
        rho = self.rho_of(groups)
        if self.cfg.conversion == "tight" and math.isfinite(rho):
            return float(rdplib.compute_epsilon(ORDERS, rho * np.array(ORDERS), delta)[0])
        return zcdp_to_epsilon(rho, delta)

    def _delta(self, groups, epsilon):
        rho = self.rho_of(groups)
        if self.cfg.conversion == "tight" and math.isfinite(rho):
            return float(rdplib.compute_delta(ORDERS, rho * np.array(ORDERS), epsilon)[0])
        return zcdp_to_delta(rho, epsilon)

    def spent(self):
        out = super().spent() if self.budget.delta is not None else {
            "epsilon": None, "delta": None, "target_epsilon": self.budget.epsilon,
            "accountant": self.name, "notion": self.notion, "relation": self.budget.relation}
        out["rho"] = self.rho()
        out["target_rho"] = self.budget_rho() if self.has_budget() else None
        return out


ACCOUNTANTS = (RdpAccountant, RdpFilter, PldAccountant, ZcdpAccountant)
