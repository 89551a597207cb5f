"""The privacy-cost table of a run: every ledger entry with its zCDP cost (spec 004 §2, ledger table).

Computed here from the events alone (Gaussian: Δ²/(2σ²); exponential mechanism: ε²/8 bounded
range, else ε²/2; a zCDP event: its ρ), independently of the accountant, so a test can hold the
two against each other.
"""

from __future__ import annotations

import math
from typing import Any

from dpregistry.privacy.events import Exponential, Gaussian, PrivacyEvent, ZCDP


def event_rho(event: PrivacyEvent) -> float:
    if isinstance(event, Gaussian):
        return math.inf if event.std == 0 else event.sensitivity ** 2 / (2.0 * event.std ** 2)
    if isinstance(event, Exponential):
        return event.epsilon ** 2 / (8.0 if event.bounded_range else 2.0)
    if isinstance(event, ZCDP):
        return event.rho
    raise ValueError(f"no closed-form zCDP cost for {event.type!r} events")


def cost_table(ledger_entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows {query, count, first_step, last_step, rho_each, rho} of a ledger (``Ledger.to_json()``),
    merged by event in order of first use."""
    rows: dict[PrivacyEvent, dict[str, Any]] = {}
    for e in ledger_entries:
        ev = PrivacyEvent.from_dict(e["event"])
        row = rows.get(ev)
        if row is None:
            row = rows[ev] = {"query": ev.describe(), "count": 0, "first_step": e["first_step"],
                              "last_step": e["last_step"], "rho_each": event_rho(ev), "rho": 0.0}
        row["count"] += e["count"]
        row["last_step"] = max(row["last_step"], e["last_step"])
        row["rho"] = row["count"] * row["rho_each"]
    return list(rows.values())


def format_table(rows: list[dict[str, Any]], budget: float | None = None, limit: int | None = None) -> str:
    """The table as text; ``limit`` shows the first rows only (the total always covers all)."""
    lines = [f"{'query':<34} {'count':>8} {'ρ each':>11} {'ρ':>11}"]
    for r in rows[:limit]:
        lines.append(f"{r['query']:<34} {r['count']:>8} {r['rho_each']:>11.4g} {r['rho']:>11.4g}")
    if limit is not None and len(rows) > limit:
        rest = rows[limit:]
        lines.append(f"{f'… {len(rest)} more':<34} {sum(r['count'] for r in rest):>8} {'':>11} "
                     f"{sum(r['rho'] for r in rest):>11.4g}")
    total = sum(r["rho"] for r in rows)
    lines.append(f"{'total':<34} {sum(r['count'] for r in rows):>8} {'':>11} {total:>11.6g}"
                 + (f"  (budget {budget:g})" if budget is not None else ""))
    return "\n".join(lines)
