"""Accountant contract, the privacy ledger and the budget.

The ledger is the record of every charge, in order, run-length encoded. It is part of every
checkpoint; a resume restores it and keeps charging, so nothing resets it. Accountants compute
their guarantee from the ledger alone, which is what makes a restored ledger exact.

Parallel composition: a charge may name the *partition* of the data it touches (an O2NC episode
on disjoint records, a shuffled epoch). Every record lies in exactly one partition, so a record's
loss is the composition of the unpartitioned charges with those of its own partition; the
accountant reports the worst partition.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, ClassVar, Iterable

from ..errors import BudgetExhausted, UserError
from ..stages import Charge, Stage, StageParams
from .events import RELATIONS, PrivacyEvent, nodes


@dataclass
class Budget:
    """The target of a run: (ε, δ) and/or ρ (zCDP). ``relation`` is the neighbouring relation."""

    epsilon: float | None = None
    delta: float | None = None
    rho: float | None = None
    relation: str = "replace_one"

    def __post_init__(self):
        if self.relation not in RELATIONS:
            raise ValueError(f"relation must be one of {RELATIONS}")

    @property
    def is_set(self) -> bool:
        """Whether there is a target to enforce: (ε, δ) or ρ."""
        return (self.epsilon is not None and self.delta is not None) or self.rho is not None


class Ledger:
    """Every charge of a run, in order: [{event, count, partition, first_step, last_step}]."""

    def __init__(self, entries: list[dict[str, Any]] | None = None):
        self.entries: list[dict[str, Any]] = entries or []
        self._events: list[PrivacyEvent] = [PrivacyEvent.from_dict(e["event"]) for e in self.entries]

    def add(self, charge: Charge, step: int) -> None:
        last = self.entries[-1] if self.entries else None
        if (last and self._events[-1] == charge.event and last["partition"] == charge.partition
                and last["last_step"] in (step, step - 1)):
            last["count"] += charge.count
            last["last_step"] = step
        else:
            self.entries.append({"event": charge.event.to_dict(), "count": charge.count,
                                 "partition": charge.partition, "first_step": step, "last_step": step})
            self._events.append(charge.event)

    def grouped(self, extra: Iterable[Charge] = ()) -> dict[str | None, Counter]:
        """{partition: Counter(event -> count)} over the ledger plus ``extra`` charges."""
        out: dict[str | None, Counter] = {}
        for e, ev in zip(self.entries, self._events):
            out.setdefault(e["partition"], Counter())[ev] += e["count"]
        for c in extra:
            out.setdefault(c.partition, Counter())[c.event] += c.count
        # A zero count charges nothing; kept, 0·∞ would be a NaN that dp-accounting reads as ε = 0.
        return {p: +c for p, c in out.items()}

    @property
    def events(self) -> list[PrivacyEvent]:
        """The distinct events charged, in order of their entries."""
        return list(self._events)

    @property
    def n_charges(self) -> int:
        return sum(e["count"] for e in self.entries)

    @property
    def last_step(self) -> int | None:
        return max((e["last_step"] for e in self.entries), default=None)

    def until(self, step: int) -> "Ledger":
        """The charges made at steps <= ``step``. An entry that spans ``step`` keeps its share,
        rounded up (entries merge consecutive steps, usually one charge per step)."""
        out = []
        for e in self.entries:
            if e["first_step"] > step:
                continue
            e = dict(e)
            if e["last_step"] > step:
                span = e["last_step"] - e["first_step"] + 1
                e["count"] = -(-e["count"] * (step - e["first_step"] + 1) // span)
                e["last_step"] = step
            out.append(e)
        return Ledger(out)

    def to_json(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    @staticmethod
    def from_json(entries: list[dict[str, Any]]) -> "Ledger":
        return Ledger([dict(e) for e in entries])


class LedgerView:
    """The ledger as stages read it (``Context.ledger``): its entries come as copies, so a stage that
    edits what it read (a count lowered, an entry dropped) leaves the run's ledger as it was."""

    def __init__(self, ledger: Ledger):
        self._ledger = ledger

    @property
    def entries(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._ledger.entries)

    def grouped(self, extra: Iterable[Charge] = ()) -> dict[str | None, Counter]:
        return self._ledger.grouped(extra)

    @property
    def events(self) -> list[PrivacyEvent]:
        return self._ledger.events

    @property
    def n_charges(self) -> int:
        return self._ledger.n_charges

    @property
    def last_step(self) -> int | None:
        return self._ledger.last_step


class Accountant(Stage):
    """Consumes privacy events and reports the guarantee they add up to.

    Subclasses implement ``_epsilon(groups, delta)`` and ``_delta(groups, epsilon)`` over grouped
    charges (``{partition: Counter(event -> count)}``), and say which ``notion`` they state
    and whether they are a valid privacy filter under fully adaptive composition. The budget
    decision is ``_fits``; calibration solves for the root of ``_slack`` (log spent/budget, <= 0
    exactly when ``_fits``), so an accountant that budgets in another currency (ρ, RDP at one
    order) overrides both.
    """

    kind = "accountant"
    notion: ClassVar[str] = "approx_dp"  # "approx_dp" | "rdp" | "zcdp"
    #: valid as a privacy filter when costs are chosen adaptively (Feldman–Zrnic); PLD is not
    can_filter: ClassVar[bool] = False
    #: event types it can compose
    supports: ClassVar[frozenset[str]] = frozenset()
    #: enforces a zCDP budget (privacy.rho); a run refuses privacy.rho with one that does not,
    #: rather than let it be ignored
    budgets_rho: ClassVar[bool] = False
    needs = (Budget,)

    class Params(StageParams):
        pass

    def __init__(self, params=None):
        super().__init__(params)
        self.ledger = Ledger()
        self.budget = Budget()
        self._approved: Counter = Counter()

    # -- binding -------------------------------------------------------------------------

    def bind(self, budget: Budget) -> None:
        self.budget = budget

    def setup(self, ctx) -> None:
        self.bind(ctx.need(Budget))

    # -- what subclasses implement ---------------------------------------------------------

    def _epsilon(self, groups: dict[str | None, Counter], delta: float) -> float:
        raise NotImplementedError

    def _delta(self, groups: dict[str | None, Counter], epsilon: float) -> float:
        raise NotImplementedError

    def _fits(self, groups: dict[str | None, Counter]) -> bool:
        """Whether ``groups`` stay within the budget (ε at the target δ by default)."""
        return self._slack(groups) <= 0

    def _slack(self, groups: dict[str | None, Counter]) -> float:
        """log(spent / budget): <= 0 exactly when ``groups`` fit. Calibration solves for its root,
        so a smooth slack (rather than a yes/no answer) makes it converge in a few evaluations."""
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError(f"accountant {self.name!r} needs privacy.epsilon and privacy.delta")
        eps = self._epsilon(groups, b.delta)
        return _log_ratio(eps, b.epsilon)

    # -- public API ---------------------------------------------------------------------------

    def check_events(self, events: Iterable[PrivacyEvent]) -> None:
        """Raise UserError for an event type this accountant cannot compose."""
        for e in events:
            for ev in nodes(e):
                if ev.type not in self.supports:
                    raise UserError(f"accountant {self.name!r} cannot account {ev.type!r} events; "
                                    f"it supports {', '.join(sorted(self.supports))}", key="accountant")

    def epsilon(self, delta: float | None = None, extra: Iterable[Charge] = ()) -> float:
        delta = self.budget.delta if delta is None else delta
        if delta is None:
            raise UserError("a δ is needed to report ε (set privacy.delta)")
        groups = self.ledger.grouped(extra)
        if not any(groups.values()):
            return 0.0
        return self._epsilon(groups, delta)

    def delta(self, epsilon: float) -> float:
        groups = self.ledger.grouped()
        if not any(groups.values()):
            return 0.0
        return self._delta(groups, epsilon)

    def fits(self, extra: Iterable[Charge] = ()) -> bool:
        """Whether the ledger plus ``extra`` stays within the budget (always, without a budget:
        a run with no target, such as non-private MeZO, is recorded but not limited)."""
        if not self.budget.is_set:
            return True
        return self._fits(self.ledger.grouped(list(extra)))

    def approve(self, plan: list[Charge]) -> None:
        """Check a whole planned run against the budget; remember it so that charges matching
        the plan need no recomputation (a PLD composition per step would be slow)."""
        if not self.fits(plan):
            raise BudgetExhausted("the planned run does not fit the privacy budget")
        self._approved = Counter()
        for c in plan:
            self._approved[(c.event, c.partition)] += c.count

    def has_budget(self) -> bool:
        return self.budget.is_set

    def can_afford(self, charges: Iterable[Charge]) -> bool:
        charges = list(charges)
        if not self.has_budget():  # a run without a budget (non-private, σ = 0) is only recorded
            return True
        need: Counter = Counter()
        for c in charges:
            need[(c.event, c.partition)] += c.count
        if all(self._approved[k] >= n for k, n in need.items()):
            return True
        # Not (all) planned: it must fit together with the rest of the approved plan, which the
        # shortcut above will let through later without another check.
        rest = self._approved - need
        return self.fits(charges + [Charge(e, p, n) for (e, p), n in rest.items()])

    def charge(self, charges: Iterable[Charge], step: int) -> None:
        """Charge, or raise BudgetExhausted (nothing is charged then)."""
        charges = list(charges)
        if not self.can_afford(charges):
            raise BudgetExhausted(f"charging step {step} would exceed the privacy budget")
        for c in charges:
            k = (c.event, c.partition)
            self._approved[k] = max(0, self._approved[k] - c.count)
            self.ledger.add(c, step)

    def overspend(self, extra: Iterable[Charge] = ()) -> str:
        """What the ledger plus ``extra`` spends, against the budget (for error messages)."""
        b = self.budget
        eps = self.epsilon(extra=extra)
        return f"ε = {eps:.6g} at δ = {b.delta:g}, more than the budget ε = {b.epsilon:g}"

    def spent(self) -> dict[str, float | str | None]:
        b = self.budget
        eps = self.epsilon() if b.delta is not None else None
        return {"epsilon": eps, "delta": b.delta, "target_epsilon": b.epsilon,
                "accountant": self.name, "notion": self.notion, "relation": b.relation}

    def calibrate(self, plan: Callable[[float], list[Charge]], *, lo: float = 1e-2, hi: float = 1e3,
                  rtol: float = 1e-4, guess: float = 1.0) -> float:
        """The smallest noise multiplier in [lo, hi] whose planned run (on top of the ledger) fits
        the budget, to a relative ``rtol``.

        Returns the fitting end of the final bracket, so the result always fits.
        """
        return solve_boundary(lambda z: self._slack(self.ledger.grouped(plan(z))),
                              lo=lo, hi=hi, rtol=rtol, guess=guess)

    def rho(self) -> float | None:
        """The zCDP ρ the ledger has spent, for accountants that keep it (None: this one does not)."""
        return None

    def remaining(self) -> float | None:
        """What is left of the budget in the filter's own currency (ρ for zcdp, the RDP value at
        the filter's order for rdp_filter); None for accountants that are not filters."""
        return None

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.to_json()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger = Ledger.from_json(state.get("ledger", []))
        self._approved = Counter()  # approved against another ledger: the remaining plan is approved anew



# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _log_ratio(spent: float, budget: float) -> float:
    if spent <= 0:
        return -math.inf
    if math.isinf(spent) or math.isnan(spent) or not budget > 0:  # a budget that underflowed to 0
        return math.inf
    return math.log(spent / budget)


def _consistent(slack: float, fits: bool) -> float:
    """A slack whose sign agrees with the exact fit decision (they can differ by rounding)."""
    if (slack <= 0) == fits:
        return slack
    return -5e-324 if fits else 5e-324


def solve_boundary(slack: Callable[[float], float], *, lo: float, hi: float, rtol: float,
                   guess: float = 1.0, known: Iterable[tuple[float, float]] = (),
                   slope: float = 1.0) -> float:
    """The smallest z in [lo, hi] with ``slack(z) <= 0``, for a slack that decreases in z.

    ``known`` are (z, slack(z)) pairs already computed; ``slope`` is a rough -d slack/d log z used
    to size the first bracketing steps (1 suits ε ∝ 1/z). The search brackets the boundary,
    then narrows the bracket by regula falsi on (log z, slack) with the Illinois modification
    (fast on the near-linear log-log curves of privacy losses), falling back to bisection where
    the slack is infinite. Returns the fitting end of a bracket [a, b] with b/a <= 1 + rtol,
    whose other end was evaluated and does not fit: the result always fits, and is tight.
    """
    if not (0 < lo < hi and rtol > 0):
        raise ValueError("need 0 < lo < hi and rtol > 0")
    tol = math.log1p(rtol)
    ulo, uhi = math.log(lo), math.log(hi)
    pts = [(math.log(z), s) for z, s in known]
    at = {math.log(z): z for z, _ in known}  # the z each point was evaluated at (exp∘log may differ by an ulp)

    def ev(u: float) -> float:
        at[u] = z = lo if u == ulo else hi if u == uhi else math.exp(u)
        s = slack(z)
        pts.append((u, s))
        return s

    if not pts:
        ev(min(max(math.log(guess), ulo), uhi))
    walks = 0
    while True:  # bracket: the highest point that does not fit, the lowest fitting point above it
        unfit = [p for p in pts if not p[1] <= 0]
        a = max(unfit) if unfit else None
        fit = [p for p in pts if p[1] <= 0 and (a is None or p[0] > a[0])]
        b = min(fit) if fit else None
        if a is not None and b is not None:
            break
        end = a if b is None else b
        s = end[1]
        pred = abs(s) / slope if math.isfinite(s) else math.inf  # predicted distance to the boundary
        if pred < tol:                  # just past the boundary, close enough to end the search
            step = min(pred + tol / 3, tol * (1 - 1e-6))
        else:
            step = min(1.5 * pred, math.log(4.0))
        step *= 2 ** walks
        walks += 1
        if b is None:
            if end[0] >= uhi - 1e-12:
                raise UserError(f"no noise multiplier up to {hi:g} meets the budget; "
                                "lower the steps or the sampling rate, or raise the budget")
            ev(min(uhi, end[0] + step))
        else:
            if end[0] <= ulo + 1e-12:
                return at[end[0]]
            ev(max(ulo, end[0] - step))
    (a, sa), (b, sb) = a, b
    last = 0
    while b - a > tol:
        w = b - a
        if math.isfinite(sa) and math.isfinite(sb) and sa != sb:
            u = b - sb * w / (sb - sa)
        else:
            u = a + w / 2
        # aim a third of the tolerance past the estimate, on the side that did not move last:
        # two good estimates then straddle the boundary and close the bracket
        u += -tol / 3 if last == 1 else tol / 3
        margin = min(tol / 3, w / 4)
        u = min(max(u, a + margin), b - margin)
        su = ev(u)
        if su <= 0:
            b, sb = u, su
            if last == 1:
                sa /= 2                          # Illinois: the stale end loses weight
            last = 1
        else:
            a, sa = u, su
            if last == -1:
                sb /= 2
            last = -1
    return at[b]


#: relative error margin of a float sum of non-negative costs (see ``total_fits``)
_MARGIN = 2.0 ** -48


def total_fits(terms: dict[str | None, list[tuple[int, float]]], budget: float) -> bool:
    """Whether Σ_unpartitioned + max_partition Σ count·cost <= budget, never rounding in the
    spender's favour.

    ``terms`` maps a partition (None: all records) to (count, cost) pairs. The float sum is off
    from the exact one by far less than a relative 2^-48; outside that window it decides, inside
    it the sum is recomputed exactly in rationals (so a budget split exactly, like T charges of
    ρ/T, still fits, and a total one ulp over the budget does not).
    """
    def float_total(pairs):
        return math.fsum(n * c for n, c in pairs)

    parts = {p: float_total(v) for p, v in terms.items()}
    base = parts.pop(None, 0.0)
    total = base + (max(parts.values()) if parts else 0.0)
    if math.isnan(total):
        return False
    if math.isinf(total) or math.isinf(budget):
        return total <= budget
    if total <= budget * (1 - _MARGIN):
        return True
    if total > budget * (1 + _MARGIN):
        return False

    def exact(pairs):
        return sum((Fraction(n) * Fraction(c) for n, c in pairs), Fraction(0))

    ex = {p: exact(v) for p, v in terms.items()}
    ebase = ex.pop(None, Fraction(0))
    return ebase + (max(ex.values()) if ex else Fraction(0)) <= Fraction(budget)


def make_accountant(section: str | dict[str, Any], privacy: dict[str, Any] | Budget | None = None) -> Accountant:
    """An accountant from a recipe's ``accountant`` section (a name, or a mapping with ``name``
    and its parameters) bound to a budget (a recipe's ``privacy`` section, or a Budget)."""
    from ..registry import get_registry

    spec = {"name": section} if isinstance(section, str) else dict(section)
    name = spec.pop("name")
    cls = get_registry().get("accountant", name).cls
    acc = cls(cls.Params.model_validate(spec))
    if isinstance(privacy, Budget):
        acc.bind(privacy)
    elif privacy:
        acc.bind(Budget(privacy.get("epsilon"), privacy.get("delta"), privacy.get("rho"),
                        privacy.get("relation", "replace_one")))
    return acc


def largest_extra(terms: dict[str | None, list[tuple[int, float]]], budget: float,
                  partition: str | None = None) -> float:
    """The largest float cost that one more charge in ``partition`` may have and still pass
    :func:`total_fits` (0 when nothing is left). Computed exactly, in rationals."""
    if math.isinf(budget):
        return budget
    if any(math.isinf(c) or math.isnan(c) for v in terms.values() for _, c in v):
        return 0.0
    ex = {p: sum((Fraction(n) * Fraction(c) for n, c in v), Fraction(0)) for p, v in terms.items()}
    base = ex.pop(None, Fraction(0))
    worst = max(ex.values(), default=Fraction(0))
    if base + worst > Fraction(budget):
        return 0.0
    room = Fraction(budget) - base - (worst if partition is None else ex.get(partition, Fraction(0)))
    c = float(room)
    if Fraction(c) > room:
        c = math.nextafter(c, 0.0)
    return max(c, 0.0)
