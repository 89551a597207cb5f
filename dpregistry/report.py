"""Reports on a finished (or interrupted) run: the privacy ledger and plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from . import checkpoint as ckpt
from .errors import UserError
from .privacy.accountant import Accountant, Ledger, make_accountant
from .privacy.events import PrivacyEvent

PLOT_NAME = "privacy_epsilon.png"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plot(path: Path, series: list[tuple[str, list, list]], title: str, limits: dict[str, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limits = limits or {}
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2), squeeze=False)
    for ax, (label, xs, ys) in zip(axes[0], series):
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None)
        if label in limits:
            ax.axhline(limits[label], color="tab:red", linestyle="--", linewidth=1, label="budget")
            ax.legend(loc="lower right")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spent_curve(acc: Accountant, ledger: Ledger, points: int = 25) -> list[tuple[int, float]]:
    """(steps completed, privacy spent) along a ledger, at up to ``points`` steps: ε at the
    budget's δ, or ρ for a zCDP accountant without δ. The charges of step index s count once
    s + 1 steps are complete (the convention of metrics.jsonl)."""
    last = ledger.last_step
    if last is None:
        return []
    n = last + 1
    steps = sorted({max(1, round(n * i / points)) for i in range(1, points + 1)} | {n})
    use_rho = acc.budget.delta is None
    if use_rho and not hasattr(acc, "rho"):
        return []
    out = []
    full = acc.ledger
    try:
        for k in steps:
            acc.ledger = ledger.until(k - 1)
            out.append((k, acc.rho() if use_rho else acc.epsilon()))
    finally:
        acc.ledger = full
    return out


def privacy_report(run_dir: Path, *, points: int = 25, plot: bool = True) -> dict[str, Any]:
    """Ledger, privacy spent over steps and the accountant of ``run_dir``, recomputed from the
    ledger of its newest valid checkpoint; writes ``privacy_epsilon.png`` beside it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError("run folder not found", file=str(run_dir))
    found = ckpt.latest_valid(run_dir / "checkpoints", warn=lambda m: None)
    if found is None:
        raise UserError("no readable checkpoint in this run folder", file=str(run_dir))
    _, meta, _ = found
    recipe = meta["recipe"]
    privacy = recipe["privacy"]
    acc = make_accountant(recipe["accountant"], privacy)
    acc.ledger = Ledger.from_json(meta.get("ledger", []))
    spent = acc.spent()
    curve = spent_curve(acc, acc.ledger, points)
    label = "ρ spent" if acc.budget.delta is None else "ε spent"
    target = spent.get("target_rho") if acc.budget.delta is None else privacy.get("epsilon")
    plot_path = None
    if plot and curve:
        plot_path = run_dir / PLOT_NAME
        _plot(plot_path, [(label, [k for k, _ in curve], [v for _, v in curve])],
              f"{recipe['algorithm']['name']}: privacy spent ({acc.name}, "
              f"{privacy['relation'].replace('_', '-')})",
              {label: target} if target is not None and math.isfinite(target) else None)
    ledger = [dict(e, describe=PrivacyEvent.from_dict(e["event"]).describe()) for e in acc.ledger.to_json()]
    return {
        "run": str(run_dir), "step": meta["step"], "accountant": acc.name, "notion": acc.notion,
        "relation": privacy["relation"], "epsilon": spent.get("epsilon"), "delta": privacy.get("delta"),
        "target_epsilon": privacy.get("epsilon"), "rho": spent.get("rho"), "target_rho": spent.get("target_rho"),
        "noise_multiplier": meta.get("noise_multiplier"), "charges": acc.ledger.n_charges,
        "ledger": ledger, "spent_label": label, "spent_over_steps": curve,
        "plot": str(plot_path) if plot_path else None,
    }
