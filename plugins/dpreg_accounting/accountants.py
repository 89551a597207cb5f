"""RDP, PLD and zCDP accountants, and the Rényi/zCDP privacy filters.

Every curve and every PLD comes from Google's ``dp-accounting``; this module only maps
dpregistry's events onto its DpEvents, with the sensitivity convention of
:mod:`dpregistry.privacy.events` (``Gaussian.sensitivity`` is the L2 distance between
neighbouring outputs). The mapping per relation is:

* plain Gaussian: noise multiplier std/Δ; the curve does not depend on the relation.
* Poisson, add/remove: dp-accounting's add/remove analysis with multiplier std/Δ (Δ = C).
* Poisson, replace-one: PLD uses dp-accounting's tight REPLACE_ONE analysis (per-record bound
  Δ/2). RDP has no replace-one analysis for Poisson sampling; it uses add/remove at the doubled
  sensitivity Δ = 2C (multiplier std/2C), which upper-bounds the replace-one curve (tested
  against numerical Rényi divergences and the tight PLD). This is also the convention of the
  DPZero code (std = 2·m·C/B, DPZero spec §4.2).
* sampling without replacement (replace-one): RDP of Wang–Balle–Kasiviswanathan 2019 via
  dp-accounting, multiplier std/Δ with the replace-one Δ = 2C. PLD has no such analysis and
  refuses it; zCDP charges it unamplified.
* several releases of one sampled batch (``Composed`` inside a sampling event): the Gaussian they
  compose to, (Δ/σ)² = Σ (Δ_i/σ_i)² (a record is in all of them or in none).
* tree aggregation: a record enters ⌊log₂T⌋+1 nodes of sensitivity Δ, each with noise std, so one
  period is a Gaussian mechanism of sensitivity Δ·sqrt(⌊log₂T⌋+1) (spec 001 §2.4, spec 002 §2.3).
* exponential mechanism (pure ε-DP): ε²/8-zCDP (bounded range, Cesar–Rogers) or ε²/2 (Bun–Steinke
  Prop 1.4) for RDP and zCDP (spec 004 §2); the PLD of a pure ε-DP mechanism for PLD.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from functools import lru_cache

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import common as pldcommon
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pldlib
from dp_accounting.rdp import rdp_privacy_accountant as rdplib
from pydantic import Field

from dpregistry.errors import UserError
from dpregistry.progress import say
from dpregistry.privacy.accountant import (Accountant, _consistent, _log_ratio, largest_extra, solve_boundary,
                                           total_fits)
from dpregistry.privacy.conversions import epsilon_to_zcdp, gaussian_zcdp, zcdp_to_delta, zcdp_to_epsilon
from dpregistry.privacy.events import (Composed, Exponential, Gaussian, NonPrivate, PoissonSampled,
                                       PrivacyEvent, SampledWithoutReplacement, SelfComposed,
                                       TreeAggregation, ZCDP, leaves)
from dpregistry.stages import StageParams

# dp-accounting warns (through absl) about fractional orders it drops; the result stays valid.
logging.getLogger("absl").setLevel(logging.ERROR)

NR = dpa.NeighboringRelation
ORDERS = tuple(rdplib.DEFAULT_RDP_ORDERS)

#: The noise multipliers (σ/Δ) dp-accounting computes reliably: below Z_MIN its curves overflow or
#: come out as 0 (an ε of 0 for σ/Δ = 1e-160), so such a release is charged as non-private (ε = ∞,
#: the truth for any use: ε > 10^5 per step); above Z_MAX they overflow, so it is charged at Z_MAX
#: (privacy loss falls as σ grows: an upper bound, off by less than 10^-16 in ε).
Z_MIN, Z_MAX = 1e-3, 1e8


def _in_range(z: float) -> float | None:
    """The multiplier to account a release of noise multiplier ``z`` at (None: as non-private)."""
    return None if not z >= Z_MIN else min(z, Z_MAX)


def _gaussian_multiplier(ev: PrivacyEvent) -> float:
    if isinstance(ev, Composed):  # releases of one batch: the Gaussian with (Δ/σ)² = Σ (Δ_i/σ_i)²
        zs = [_gaussian_multiplier(e) for e in ev.events]
        # (1/z)·(1/z) is inf for a tiny z where z ** -2 raises OverflowError
        return 0.0 if not zs or min(zs) == 0 else 1.0 / math.sqrt(math.fsum((1 / z) * (1 / z) for z in zs))
    if isinstance(ev, TreeAggregation):
        ev = ev.as_gaussian()
    if not isinstance(ev, Gaussian):
        raise UserError(f"only Gaussian mechanisms can be subsampled, got {ev.type!r}")
    return ev.noise_multiplier


def _partition_sum(groups, value) -> dict:
    """{partition: [(count, value(event))]} over base events (for the filters' exact totals)."""
    out: dict = {}
    for p, c in groups.items():
        pairs = out.setdefault(p, [])
        for event, n in c.items():
            for ev, m in leaves(event, n):
                pairs.append((m, value(ev)))
    return out


# ------------------------------------------------------------------------------------------
# RDP
# ------------------------------------------------------------------------------------------


def _to_rdp_event(ev: PrivacyEvent, relation: str):
    """(dp-accounting event, dp-accounting relation) for the RDP accountant."""
    if isinstance(ev, TreeAggregation):  # a dp-accounting event, not a ρ: Gaussian of sensitivity Δ·sqrt(nodes)
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        z = _in_range(ev.noise_multiplier)
        return (dpa.GaussianDpEvent(z) if z else dpa.NonPrivateDpEvent()), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, PoissonSampled):
        z = _in_range(_gaussian_multiplier(ev.event))
        if not z:  # a sampled record's release is exposed: no ε at any δ below q (dp-accounting has no event for it)
            return dpa.NonPrivateDpEvent(), NR.ADD_OR_REMOVE_ONE
        # replace-one: add/remove at the doubled sensitivity (module docstring); the event's Δ
        # already is the replace-one distance 2C, so std/Δ is that multiplier.
        return dpa.PoissonSampledDpEvent(ev.q, dpa.GaussianDpEvent(z)), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, SampledWithoutReplacement):
        if relation != "replace_one":
            raise UserError("sampling without replacement is analysed under replace-one only "
                            "(privacy.relation: replace_one)")
        z = _in_range(_gaussian_multiplier(ev.event))
        if not z:
            return dpa.NonPrivateDpEvent(), NR.REPLACE_ONE
        return dpa.SampledWithoutReplacementDpEvent(ev.n, ev.batch_size, dpa.GaussianDpEvent(z)), NR.REPLACE_ONE
    if isinstance(ev, ZCDP):
        return dpa.ZCDpEvent(ev.rho), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, Exponential):
        return dpa.ZCDpEvent(ev.zcdp_rho()), NR.ADD_OR_REMOVE_ONE
    if isinstance(ev, NonPrivate):
        return dpa.NonPrivateDpEvent(), NR.ADD_OR_REMOVE_ONE
    raise UserError(f"the rdp accountant cannot account {ev.type!r} events")


@lru_cache(maxsize=8192)
def rdp_curve(ev: PrivacyEvent, relation: str, orders: tuple = ORDERS) -> np.ndarray:
    """RDP curve of one event at ``orders`` (composition adds curves, so counts multiply it)."""
    if isinstance(ev, Composed):
        out = sum((rdp_curve(e, relation, orders) for e in ev.events), np.zeros(len(orders)))
    elif isinstance(ev, SelfComposed):
        out = ev.count * rdp_curve(ev.event, relation, orders)
    else:
        dp_event, nr = _to_rdp_event(ev, relation)
        acc = dpa.rdp.RdpAccountant(list(orders), nr)
        acc.compose(dp_event)
        out = np.array(acc.rdp, dtype=float)
    out.flags.writeable = False  # cached: shared by every caller
    return out


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

    def curve(self, groups, orders: tuple | None = None) -> np.ndarray:
        """Σ unpartitioned curves + order-wise max over partitions (each record is in one)."""
        rel = self.budget.relation
        orders = orders or self.orders
        part = {p: sum((n * rdp_curve(k, rel, orders) for k, n in c.items()), np.zeros(len(orders)))
                for p, c in groups.items()}
        base = part.pop(None, np.zeros(len(orders)))
        worst = np.max(np.stack(list(part.values())), axis=0) if part else 0.0
        return base + worst

    def _epsilon_order(self, groups, delta, orders=None) -> tuple[float, float]:
        orders = orders or self.orders
        eps, order = rdplib.compute_epsilon(orders, self.curve(groups, orders), delta)
        return float(eps), float(order)

    def _epsilon(self, groups, delta):
        return self._epsilon_order(groups, delta)[0]

    def _delta(self, groups, epsilon):
        d, _ = rdplib.compute_delta(self.orders, self.curve(groups), epsilon)
        return float(d)

    def _on_orders(self, plan, orders: tuple):
        """The calibration slack of ``plan(z)`` on a subset of the orders (an upper bound on ε)."""
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError(f"accountant {self.name!r} needs privacy.epsilon and privacy.delta")
        return lambda z: _log_ratio(self._epsilon_order(self.ledger.grouped(plan(z)), b.delta, orders)[0],
                                    b.epsilon)

    def _sparse_orders(self) -> tuple:
        """Every 8th order up to 256 (the highest orders cost the most and matter only at tiny ε)."""
        low = [a for a in self.orders if a <= 256]
        return tuple(sorted(set(low[::8]) | set(low[-1:]))) or self.orders

    def rough_calibrate(self, plan, *, lo=1e-2, hi=1e3, rtol=1e-2, guess=1.0) -> float:
        """A multiplier that fits, within ~``rtol`` of the RDP optimum, on a sparse set of orders."""
        return solve_boundary(self._on_orders(plan, self._sparse_orders()), lo=lo, hi=hi, rtol=rtol, guess=guess)

    def calibrate(self, plan, *, lo=1e-2, hi=1e3, rtol=1e-4, guess=1.0):
        """Solve on a window of orders around the optimal one, then confirm on every order.

        The ε of a subset of orders upper-bounds the ε of all of them, so every multiplier that
        fits on a subset fits. A rough search on every 8th order locates the optimal order; the
        fine search runs on the orders around it; one evaluation on every order then checks that
        the optimum lies inside the window (else the window moves), which makes the answer as
        tight as a search on every order. Most of the cost of a full curve is in the high
        orders, which the window skips.
        """
        b = self.budget
        orders = self.orders
        sparse = self._sparse_orders()
        z = self.rough_calibrate(plan, lo=lo, hi=hi, rtol=0.05, guess=guess)
        centre = orders.index(self._epsilon_order(self.ledger.grouped(plan(z)), b.delta, sparse)[1])
        for _ in range(6):
            first, last = max(0, centre - 8), min(len(orders) - 1, centre + 8)
            z = solve_boundary(self._on_orders(plan, orders[first:last + 1]), lo=lo, hi=hi, rtol=rtol, guess=z)
            if z <= lo:
                return z
            centre = orders.index(self._epsilon_order(self.ledger.grouped(plan(z)), b.delta, orders)[1])
            if (first < centre or first == 0) and (centre < last or last == len(orders) - 1):
                return z
        # the optimal order kept moving (a curve with several minima): search every order
        return super().calibrate(plan, lo=lo, hi=hi, rtol=rtol, guess=z)


class RdpFilterParams(RdpParams):
    order: float | None = Field(default=None, gt=1, description="the fixed Rényi order of the filter")


@lru_cache(maxsize=4096)
def _order_budget(order: float, epsilon: float, delta: float) -> float:
    """Largest RDP value at ``order`` whose conversion gives at most ``epsilon`` at ``delta``."""
    lo, hi = 0.0, epsilon
    for _ in range(80):
        mid = (lo + hi) / 2
        if rdplib.compute_epsilon([order], [mid], delta)[0] <= epsilon:
            lo = mid
        else:
            hi = mid
    return lo


@lru_cache(maxsize=256)
def _filter_order(epsilon: float, delta: float, orders: tuple) -> float:
    """The order that allows the most Gaussian-like (linear-in-α) spend: argmax B(α)/α."""
    cands = [a for a in orders if a > 1.01]
    return max(cands, key=lambda a: _order_budget(a, epsilon, delta) / a)


class RdpFilter(RdpAccountant):
    """Rényi privacy filter at one fixed order (Feldman–Zrnic 2021): valid for adaptive costs.

    The charged RDP at the filter's order never exceeds the budget B(α) (the largest value whose
    conversion gives the target ε at δ), whatever the costs and however they were chosen.
    """

    name = "rdp_filter"
    can_filter = True
    Params = RdpFilterParams
    calibrate = Accountant.calibrate  # one order: the generic search is exact and cheap

    def validate(self, ctx):
        super().validate(ctx)
        self._need_budget()  # its budget B(α) comes from (ε, δ): refuse now, not at the first reported ε

    @property
    def order(self) -> float:
        """Fixed before any data is seen: it depends on the budget and the recipe only."""
        if self.cfg.order is not None:
            return self.cfg.order
        self._need_budget()
        return _filter_order(self.budget.epsilon, self.budget.delta, self.orders)

    def _need_budget(self):
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError("rdp_filter needs privacy.epsilon and privacy.delta")

    def order_budget(self) -> float:
        self._need_budget()
        return _order_budget(self.order, self.budget.epsilon, self.budget.delta)

    def _terms(self, groups):
        a, rel = self.order, self.budget.relation
        return _partition_sum(groups, lambda ev: float(rdp_curve(ev, rel, (a,))[0]))

    def curve_at(self, groups) -> float:
        parts = {p: math.fsum(n * c for n, c in v) for p, v in self._terms(groups).items()}
        base = parts.pop(None, 0.0)
        return base + (max(parts.values()) if parts else 0.0)

    def _fits(self, groups):
        return total_fits(self._terms(groups), self.order_budget())

    def _slack(self, groups):
        s = _log_ratio(self.curve_at(groups), self.order_budget())
        return _consistent(s, self._fits(groups))

    def _epsilon(self, groups, delta):
        # The filter's guarantee is stated at its fixed order.
        a = self.order
        return float(rdplib.compute_epsilon([a], [self.curve_at(groups)], delta)[0])

    def _delta(self, groups, epsilon):
        a = self.order
        return float(rdplib.compute_delta([a], [self.curve_at(groups)], epsilon)[0])

    def remaining(self, partition: str | None = None) -> float:
        """The largest RDP value at the filter's order that one more charge may have."""
        return largest_extra(self._terms(self.ledger.grouped()), self.order_budget(), partition)

    def overspend(self, extra=()):
        a, spent, budget = self.order, self.curve_at(self.ledger.grouped(list(extra))), self.order_budget()
        return (f"RDP {spent:.6g} at order {a:g}, more than the budget {budget:.6g} (ε = {self.budget.epsilon:g} "
                f"at δ = {self.budget.delta:g})" + _rounding_hint(spent, budget))

    def spent(self):
        out = super().spent()
        out.update(order=self.order, rdp=self.curve_at(self.ledger.grouped()), rdp_budget=self.order_budget())
        return out


def _rounding_hint(spent: float, budget: float) -> str:
    if spent <= budget * (1 + 1e-9):
        return (" — over by floating-point rounding only (the filters decide exactly); size the noise for a "
                "slightly smaller cost, for example ρ·(1 − 1e-9) per step")
    return ""


# ------------------------------------------------------------------------------------------
# PLD
# ------------------------------------------------------------------------------------------


#: The most points of a privacy-loss array the pld accountant builds. Building the PLD of one event
#: costs about 7 µs and 400 bytes a point in dp-accounting, composing about 70 bytes a point, so
#: each limit means a few hundred MB. Realistic runs need a few 10^5 (1,000,000 steps at q = 0.18
#: calibrated to ε = 3: 380,000). A loss too wide for the discretization (σ/Δ below about 0.25 at
#: 1e-4) or a composition of too many steps would need more; it is refused rather than take
#: minutes and gigabytes (the rdp accountant has no such limit).
MAX_PLD_POINTS = 1_000_000
MAX_PLD_COMPOSED_POINTS = 5_000_000


class PldTooLarge(UserError):
    """A privacy-loss array would exceed its limit."""


def _too_large(points: float, why: str, limit: int = MAX_PLD_POINTS) -> UserError:
    return PldTooLarge(f"pld: {why} needs a privacy-loss array of {points:,.0f} points, more than the limit of "
                       f"{limit:,}; use accountant rdp, or a coarser accountant.discretization", key="accountant")


def _gaussian_std(std: float, sensitivity: float, discretization: float) -> float | None:
    """The std to build the PLD of a Gaussian at (None: non-private), refusing a loss too wide for
    the array limit: the loss of σ/Δ = z spans about 2·10/z + 1/z² (dp-accounting cuts the tails
    at e^-50, |x| ≤ 10σ)."""
    z = _in_range(std / sensitivity)
    if z is None:
        return None
    points = (20 / z + 1 / (z * z)) / discretization
    if points > MAX_PLD_POINTS:
        raise _too_large(points, f"a release of σ/Δ = {z:.3g} (at discretization {discretization:g})")
    return z * sensitivity if z < std / sensitivity else std  # clamped at Z_MAX, else as given


@lru_cache(maxsize=64)
def pld_of(ev: PrivacyEvent, relation: str, discretization: float):
    """dp-accounting PLD of one base event (math.inf for a non-private one). Cached: building the
    PLD of a replace-one subsampled Gaussian at a small noise is the slow part of accounting.
    Connect-the-dots PLDs (Doroshenko et al. 2022) stay pessimistic and close to the truth even at
    coarse discretizations, which the coarse stage of calibration relies on."""
    if isinstance(ev, TreeAggregation):  # a PLD, not a ρ: the Gaussian of sensitivity Δ·sqrt(nodes)
        ev = ev.as_gaussian()
    if isinstance(ev, Gaussian):
        std = _gaussian_std(ev.std, ev.sensitivity, discretization)
        if std is None:
            return math.inf
        return pldlib.from_gaussian_mechanism(std, sensitivity=ev.sensitivity, use_connect_dots=True,
                                              value_discretization_interval=discretization)
    if isinstance(ev, PoissonSampled):
        inner = ev.event.as_gaussian() if isinstance(ev.event, TreeAggregation) else ev.event
        if isinstance(inner, Composed):  # releases of one batch (see _gaussian_multiplier)
            inner = Gaussian(std=_gaussian_multiplier(inner), sensitivity=1.0)
        if not isinstance(inner, Gaussian):
            raise UserError("pld: only Poisson-subsampled Gaussians are supported")
        std = _gaussian_std(inner.std, inner.sensitivity, discretization)
        if std is None:
            return math.inf
        if relation == "replace_one":
            # per-record bound = Δ/2: the differing record moves the sum by ±Δ/2 from the rest
            return pldlib.from_gaussian_mechanism(std, sensitivity=inner.sensitivity / 2,
                                                  sampling_prob=ev.q, neighboring_relation=NR.REPLACE_ONE,
                                                  use_connect_dots=True,
                                                  value_discretization_interval=discretization)
        return pldlib.from_gaussian_mechanism(std, sensitivity=inner.sensitivity, sampling_prob=ev.q,
                                              neighboring_relation=NR.ADD_OR_REMOVE_ONE, use_connect_dots=True,
                                              value_discretization_interval=discretization)
    if isinstance(ev, Exponential):
        points = 2 * ev.epsilon / discretization  # randomized response: losses ±ε
        if points > MAX_PLD_POINTS:
            raise _too_large(points, f"an exponential mechanism of ε = {ev.epsilon:g}")
        # any pure ε-DP mechanism is dominated by randomized response's privacy loss
        return pldlib.from_privacy_parameters(pldcommon.DifferentialPrivacyParameters(ev.epsilon, 0.0),
                                              value_discretization_interval=discretization)
    if isinstance(ev, NonPrivate):
        return math.inf
    raise UserError(f"the pld accountant cannot account {ev.type!r} events (use rdp or zcdp)", key="accountant")


def _self_compose(pld, m: int):
    """``pld.self_compose(m)`` within MAX_PLD_POINTS: the array sizes are computed first, with
    dp-accounting's own truncation bounds. A sparse PMF is made dense first when dp-accounting would
    (it decides by computing size**m, which takes minutes for m in the millions)."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    dense = []
    for pmf in pmfs:
        if isinstance(pmf, pld_pmf.SparsePLDPmf):
            if m * math.log(max(pmf.size, 1)) <= math.log(1000):  # stays sparse: at most 1000 points
                dense.append(pmf)
                continue
            keys = pmf._loss_probs
            width = max(keys) - min(keys) + 1 if keys else 1
            if width > MAX_PLD_COMPOSED_POINTS:
                raise _too_large(width, f"composing {m:,} steps", MAX_PLD_COMPOSED_POINTS)
            pmf = pmf.to_dense_pmf()
        lo, hi = pldcommon.compute_self_convolve_bounds(pmf._probs, m, 1e-15)
        if hi - lo + 1 > MAX_PLD_COMPOSED_POINTS:
            raise _too_large(hi - lo + 1, f"composing {m:,} steps", MAX_PLD_COMPOSED_POINTS)
        dense.append(pmf)
    return pldlib.PrivacyLossDistribution(*dense).self_compose(m)


@lru_cache(maxsize=16)  # a composed PLD holds up to ~1e6 floats
def _composed_pld(items: frozenset, relation: str, discretization: float):
    """The composition of base events {(event, count)} (None if empty, math.inf if non-private)."""
    total = None
    for ev, m in sorted(items, key=lambda it: (repr(it[0]), it[1])):  # a fixed order: reproducible
        p = pld_of(ev, relation, discretization)
        if p is math.inf:
            return math.inf
        p = _self_compose(p, m) if m > 1 else p
        total = p if total is None else total.compose(p)
    return total


@lru_cache(maxsize=512)
def _pld_epsilon(items: frozenset, relation: str, discretization: float, delta: float) -> float:
    pld = _composed_pld(items, relation, discretization)
    return math.inf if pld is math.inf else (0.0 if pld is None else float(pld.get_epsilon_for_delta(delta)))


def _base_items(counter: Counter) -> frozenset:
    flat: Counter = Counter()
    for event, n in counter.items():
        for ev, m in leaves(event, n):
            flat[ev] += m
    return frozenset(flat.items())


class PldParams(StageParams):
    discretization: float = Field(default=1e-4, gt=0, description="PLD value discretization interval")


class PldAccountant(Accountant):
    """Privacy loss distributions via dp-accounting (tight (ε, δ); not a valid adaptive filter)."""

    name = "pld"
    notion = "approx_dp"
    can_filter = False
    supports = frozenset({"gaussian", "poisson_sampled", "composed", "self_composed", "tree_aggregation",
                          "exponential", "non_private"})
    Params = PldParams
    _refused_size: PldTooLarge | None = None  # the last array too large for a calibration step

    def _fits(self, groups):
        try:
            return super()._fits(groups)
        except PldTooLarge:  # what cannot be computed is not approved (epsilon() says why)
            return False

    def _per_partition(self, groups) -> list[frozenset]:
        base = groups.get(None, Counter())
        parts = [c for p, c in groups.items() if p is not None] or [Counter()]
        return [_base_items(base + c) for c in parts]

    def _epsilon(self, groups, delta, discretization=None):
        d = discretization or self.cfg.discretization
        rel = self.budget.relation
        return max(_pld_epsilon(items, rel, d, delta) for items in self._per_partition(groups))

    def _delta(self, groups, epsilon):
        vals = []
        for items in self._per_partition(groups):
            pld = _composed_pld(items, self.budget.relation, self.cfg.discretization)
            vals.append(1.0 if pld is math.inf else (0.0 if pld is None else float(pld.get_delta_for_epsilon(epsilon))))
        return max(vals)

    def _slack_at(self, plan, z: float, discretization: float) -> float:
        b = self.budget
        try:
            return _log_ratio(self._epsilon(self.ledger.grouped(plan(z)), b.delta, discretization), b.epsilon)
        except PldTooLarge as e:  # not computable within the bound: taken as not fitting (calibrate says so)
            self._refused_size = e
            return math.inf

    def _calibrate(self, plan, *, lo=1e-2, hi=1e3, rtol=2e-3, guess=1.0):
        """RDP guess, coarse PLD search, fine PLD bracket.

        1. RDP on a sparse set of orders gives a close guess in milliseconds (RDP is looser than
           the PLD: by ~5% for Poisson-subsampled Gaussians, ~10% under replace-one).
        2. A search at a 10× coarser discretization (each PLD ~10× cheaper) finds the boundary to
           ``rtol``/2. Connect-the-dots PLDs are pessimistic at any discretization, and the
           coarse and fine boundaries differ by ~0.1%.
        3. At the configured discretization, the coarse answer and one point ``rtol`` below it
           usually bracket the boundary; otherwise the bracket search continues.

        The result is the fitting end of a bracket whose ends were both evaluated at the
        configured discretization: it fits, and it is within ``rtol`` of the smallest multiplier
        that fits (dp-accounting's PLD at that discretization).
        """
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError("the pld accountant needs privacy.epsilon and privacy.delta")
        fine = self.cfg.discretization
        coarse = 10 * fine if fine < 1e-3 else fine
        try:
            rdp = RdpAccountant()
            rdp.bind(b)
            rdp.ledger = self.ledger
            guess = rdp.rough_calibrate(plan, lo=lo, hi=hi, rtol=1e-2, guess=guess)
        except UserError:
            pass  # an event RDP cannot account, or no fit: the PLD search starts from ``guess``
        pts: list[tuple[float, float]] = []

        def coarse_slack(z):
            s = self._slack_at(plan, z, coarse)
            pts.append((z, s))
            return s

        z = guess
        if coarse != fine:
            z = solve_boundary(coarse_slack, lo=lo, hi=hi, rtol=rtol / 2, guess=guess * 0.97, slope=1.0)
        slope = 1.0
        below = [p for p in pts if p[1] > 0 and p[0] < z and math.isfinite(p[1])]
        at = [p for p in pts if p[0] == z]
        if below and at and math.isfinite(at[0][1]):
            (za, sa), (zb, sb) = max(below), at[0]
            if zb > za and sa > sb:
                slope = (sa - sb) / math.log(zb / za)
        known = [(z, self._slack_at(plan, z, fine))]
        return solve_boundary(lambda x: self._slack_at(plan, x, fine), lo=lo, hi=hi, rtol=rtol,
                              known=known, slope=slope)

    def calibrate(self, plan, **kw):
        self._refused_size = None
        try:
            z = self._calibrate(plan, **kw)
        except UserError:
            if self._refused_size is not None:  # no fit because nothing could be computed: say why
                raise self._refused_size from None
            raise
        if self._refused_size is not None:
            # Smaller multipliers were refused by the size bound, not found over budget: the result
            # fits, but may spend well under the target; the user should know why.
            eps, target = self._epsilon(self.ledger.grouped(plan(z)), self.budget.delta), self.budget.epsilon
            if eps < 0.98 * target:
                say(f"pld: the noise multiplier stops at {z:.4g} (ε = {eps:.4g} of {target:g}): a smaller one needs "
                    f"a privacy-loss array over the size limit; a coarser accountant.discretization (say "
                    f"{self.cfg.discretization * 10:g}) can spend the whole budget")
        return z


# ------------------------------------------------------------------------------------------
# zCDP
# ------------------------------------------------------------------------------------------


def zcdp_rho(ev: PrivacyEvent) -> float:
    """ρ of one event. Subsampling is not amplified in zCDP (a valid, conservative charge)."""
    if isinstance(ev, TreeAggregation):  # nodes·ρ(node): exact in the node count, not via √nodes
        return gaussian_zcdp(ev.sensitivity, ev.std) * ev.nodes_per_record
    if isinstance(ev, Gaussian):
        return gaussian_zcdp(ev.sensitivity, ev.std)
    if isinstance(ev, (PoissonSampled, SampledWithoutReplacement)):
        return zcdp_rho(ev.event)
    if isinstance(ev, ZCDP):
        return ev.rho
    if isinstance(ev, Exponential):
        return ev.zcdp_rho()
    if isinstance(ev, Composed):
        return math.fsum(zcdp_rho(e) for e in ev.events)
    if isinstance(ev, SelfComposed):
        return ev.count * zcdp_rho(ev.event)
    if isinstance(ev, NonPrivate):
        return math.inf
    raise UserError(f"the zcdp accountant cannot account {ev.type!r} events")


def _tight_epsilon(rho: float, delta: float) -> float:
    """dp-accounting's RDP conversion of ρα at its orders, or Bun–Steinke's if that is smaller
    (the orders stop at 1024, which misses the optimum for tiny ρ)."""
    std = zcdp_to_epsilon(rho, delta)
    if not math.isfinite(rho):
        return std
    return min(std, float(rdplib.compute_epsilon(ORDERS, rho * np.array(ORDERS), delta)[0]))


def _tight_delta(rho: float, epsilon: float) -> float:
    std = zcdp_to_delta(rho, epsilon)
    if not math.isfinite(rho) or rho == 0:
        return std
    return min(std, float(rdplib.compute_delta(ORDERS, rho * np.array(ORDERS), epsilon)[0]))


@lru_cache(maxsize=256)
def _tight_rho_budget(epsilon: float, delta: float) -> float:
    """The largest ρ whose tight conversion gives at most (ε, δ) (bisection; the lower end fits)."""
    lo = epsilon_to_zcdp(epsilon, delta)  # fits: the tight conversion is never worse
    hi = 2 * lo
    while _tight_epsilon(hi, delta) <= epsilon:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _tight_epsilon(mid, delta) <= epsilon else (lo, mid)
    return lo


class ZcdpParams(StageParams):
    conversion: str = Field(default="standard", pattern="^(standard|tight)$",
                            description="ρ→(ε,δ): Bun–Steinke's bound or dp-accounting's numerical RDP conversion")


class ZcdpAccountant(Accountant):
    """Closed-form ρ-zCDP (Bun–Steinke); composition adds ρ. A valid privacy filter.

    Under fully adaptive composition (costs chosen from earlier releases) a run that stops
    before its charged ρ exceeds the budget is ρ-zCDP (Whitehouse et al. 2023, Thm 1; spec 004
    §2): ``charge`` refuses any charge that would take the total over the budget, exactly.
    """

    name = "zcdp"
    notion = "zcdp"
    budgets_rho = True
    can_filter = True
    supports = RdpAccountant.supports
    Params = ZcdpParams

    def _terms(self, groups):
        return _partition_sum(groups, zcdp_rho)

    def rho_of(self, groups) -> float:
        parts = {p: math.fsum(n * c for n, c in v) for p, v in self._terms(groups).items()}
        base = parts.pop(None, 0.0)
        return base + (max(parts.values()) if parts else 0.0)

    def rho(self) -> float:
        return self.rho_of(self.ledger.grouped())

    def budget_rho(self) -> float:
        """privacy.rho, or the ρ whose conversion gives privacy.epsilon at privacy.delta (the
        smaller of the two when both are given: both bind)."""
        b = self.budget
        cands = [b.rho] if b.rho is not None else []
        if b.epsilon is not None and b.delta is not None:
            tight = self.cfg.conversion == "tight"
            cands.append(_tight_rho_budget(b.epsilon, b.delta) if tight else epsilon_to_zcdp(b.epsilon, b.delta))
        if not cands:
            raise UserError("the zcdp accountant needs privacy.rho, or privacy.epsilon and privacy.delta")
        return min(cands)

    def _fits(self, groups):
        return total_fits(self._terms(groups), self.budget_rho())

    def _slack(self, groups):
        return _consistent(_log_ratio(self.rho_of(groups), self.budget_rho()), self._fits(groups))

    def remaining(self, partition: str | None = None) -> float:
        """The largest ρ that one more charge (in ``partition``) may cost and still fit."""
        return largest_extra(self._terms(self.ledger.grouped()), self.budget_rho(), partition)

    def _epsilon(self, groups, delta):
        rho = self.rho_of(groups)
        if self.cfg.conversion == "tight":
            return _tight_epsilon(rho, delta)
        return zcdp_to_epsilon(rho, delta)

    def _delta(self, groups, epsilon):
        rho = self.rho_of(groups)
        if self.cfg.conversion == "tight":
            return _tight_delta(rho, epsilon)
        return zcdp_to_delta(rho, epsilon)

    def overspend(self, extra=()):
        rho, budget = self.rho_of(self.ledger.grouped(list(extra))), self.budget_rho()
        return f"ρ = {rho:.6g}, more than the budget ρ = {budget:.6g} (zCDP)" + _rounding_hint(rho, budget)

    def spent(self):
        out = super().spent() if self.budget.delta is not None else {
            "epsilon": None, "delta": None, "target_epsilon": self.budget.epsilon,
            "accountant": self.name, "notion": self.notion, "relation": self.budget.relation}
        out["rho"] = self.rho()
        out["target_rho"] = self.budget_rho() if self.has_budget() else None
        return out


ACCOUNTANTS = (RdpAccountant, RdpFilter, PldAccountant, ZcdpAccountant)
