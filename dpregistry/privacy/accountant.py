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

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable

from ..errors import BudgetExhausted, UserError
from ..stages import Charge, Stage, StageParams
from .events import RELATIONS, PrivacyEvent


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
        return out

    @property
    def n_charges(self) -> int:
        return sum(e["count"] for e in self.entries)

    def to_json(self) -> list[dict[str, Any]]:
        return [dict(e) for e in self.entries]

    @staticmethod
    def from_json(entries: list[dict[str, Any]]) -> "Ledger":
        return Ledger([dict(e) for e in entries])


class Accountant(Stage):
    """Consumes privacy events and reports the guarantee they add up to.

    Subclasses implement ``_epsilon(groups, delta)`` and ``_delta(groups, epsilon)`` over grouped
    charges (``{partition: Counter(event -> count)}``), and say which ``notion`` they state
    and whether they are a valid privacy filter under fully adaptive composition.
    """

    kind = "accountant"
    notion: ClassVar[str] = "approx_dp"  # "approx_dp" | "rdp" | "zcdp"
    #: valid as a privacy filter when costs are chosen adaptively (Feldman–Zrnic); PLD is not
    can_filter: ClassVar[bool] = False
    #: event types it can compose
    supports: ClassVar[frozenset[str]] = frozenset()

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

    def setup(self, run) -> None:
        self.bind(run.budget)

    # -- what subclasses implement ---------------------------------------------------------

    def _epsilon(self, groups: dict[str | None, Counter], delta: float) -> float:
        raise NotImplementedError

    def _delta(self, groups: dict[str | None, Counter], epsilon: float) -> float:
        raise NotImplementedError

    def _fits(self, groups: dict[str | None, Counter]) -> bool:
        """Whether ``groups`` stay within the budget (ε at the target δ by default)."""
        b = self.budget
        if b.epsilon is None or b.delta is None:
            raise UserError(f"accountant {self.name!r} needs privacy.epsilon and privacy.delta")
        return self._epsilon(groups, b.delta) <= b.epsilon

    # -- public API ---------------------------------------------------------------------------

    def check_events(self, events: Iterable[PrivacyEvent]) -> None:
        """Raise UserError for an event type this accountant cannot compose."""
        for e in events:
            stack = [e]
            while stack:
                ev = stack.pop()
                if ev.type not in self.supports:
                    raise UserError(f"accountant {self.name!r} cannot account {ev.type!r} events; "
                                    f"it supports {', '.join(sorted(self.supports))}")
                if hasattr(ev, "event"):
                    stack.append(ev.event)
                stack.extend(getattr(ev, "events", ()))

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
        """Whether the ledger plus ``extra`` stays within the budget."""
        return self._fits(self.ledger.grouped(list(extra)))

    def approve(self, plan: list[Charge]) -> None:
        """Check a whole planned run against the budget; remember it so that charges matching
        the plan need no recomputation (a PLD composition per step would be slow)."""
        if not self.fits(plan):
            raise BudgetExhausted("the planned run does not fit the privacy budget")
        self._approved = Counter()
        for c in plan:
            self._approved[(c.event, c.partition)] += c.count

    def can_afford(self, charges: Iterable[Charge]) -> bool:
        charges = list(charges)
        b = self.budget
        if (b.epsilon is None or b.delta is None) and b.rho is None:
            return True  # no budget to enforce (a non-private run, or one that only reports ε)
        need: Counter = Counter()
        for c in charges:
            need[(c.event, c.partition)] += c.count
        if all(self._approved[k] >= n for k, n in need.items()):
            return True
        return self.fits(charges)

    def charge(self, charges: Iterable[Charge], step: int) -> None:
        """Charge, or raise BudgetExhausted (nothing is charged then)."""
        charges = list(charges)
        if not self.can_afford(charges):
            raise BudgetExhausted(f"charging step {step} would exceed the privacy budget")
        for c in charges:
            k = (c.event, c.partition)
            self._approved[k] = max(0, self._approved[k] - c.count)
            self.ledger.add(c, step)

    def spent(self) -> dict[str, float | str | None]:
        b = self.budget
        eps = self.epsilon() if b.delta is not None else None
        return {"epsilon": eps, "delta": b.delta, "target_epsilon": b.epsilon,
                "accountant": self.name, "notion": self.notion, "relation": b.relation}

    def calibrate(self, plan: Callable[[float], list[Charge]], *, lo: float = 1e-2, hi: float = 1e3,
                  rtol: float = 1e-4) -> float:
        """The smallest noise multiplier whose planned run fits the budget (bisection).

        Returns the upper end of the final bracket, so the result always fits.
        """
        def ok(z: float) -> bool:
            return self.fits(plan(z))

        if not ok(hi):
            raise UserError(f"no noise multiplier up to {hi:g} meets the budget; "
                            "lower the steps or the sampling rate, or raise ε")
        if ok(lo):
            return lo
        while hi / lo > 1 + rtol:
            mid = math.sqrt(lo * hi)
            if ok(mid):
                hi = mid
            else:
                lo = mid
        return hi

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"ledger": self.ledger.to_json()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ledger = Ledger.from_json(state.get("ledger", []))

