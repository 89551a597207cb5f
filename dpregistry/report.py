"""Reports on a finished (or interrupted) run: the privacy ledger and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import checkpoint as ckpt
from .errors import UserError
from .privacy.events import PrivacyEvent


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _plot(path: Path, series: list[tuple[str, list, list]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2), squeeze=False)
    for ax, (label, xs, ys) in zip(axes[0], series):
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def privacy_report(run_dir: Path) -> dict[str, Any]:
    """Ledger, ε over steps and the accountant of ``run_dir``; writes ``privacy_epsilon.png``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError("run folder not found", file=str(run_dir))
    found = ckpt.latest_valid(run_dir / "checkpoints", warn=lambda m: None)
    if found is None:
        raise UserError("no readable checkpoint in this run folder", file=str(run_dir))
    _, meta, _ = found
    recipe = meta["recipe"]
    ledger = meta.get("ledger", [])
    from .registry import get_registry

    get_registry()  # plugins may define their own event types; loading them registers the types
    for e in ledger:
        e["describe"] = PrivacyEvent.from_dict(e["event"]).describe()
    rows = [r for r in read_metrics(run_dir) if r.get("epsilon") is not None]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    eps = summary.get("epsilon") if summary.get("step") == meta["step"] else None
    if eps is None:
        from .privacy.accountant import Budget, Ledger
        from .registry import get_registry

        acc = get_registry().get("accountant", recipe["accountant"]["name"]).cls(
            get_registry().get("accountant", recipe["accountant"]["name"]).cls.Params.model_validate(
                {k: v for k, v in recipe["accountant"].items() if k != "name"}))
        p = recipe["privacy"]
        acc.bind(Budget(p.get("epsilon"), p.get("delta"), p.get("rho"), p.get("relation", "replace_one")))
        acc.ledger = Ledger.from_json(ledger)
        eps = acc.epsilon() if p.get("delta") else None
    plot = None
    if rows:
        plot = run_dir / "privacy_epsilon.png"
        _plot(plot, [("ε spent", [r["step"] for r in rows], [r["epsilon"] for r in rows])],
              f"{recipe['algorithm']['name']}: privacy spent ({recipe['accountant']['name']})")
    return {
        "step": meta["step"], "accountant": recipe["accountant"]["name"],
        "notion": summary.get("notion") or recipe["accountant"]["name"],
        "relation": recipe["privacy"]["relation"], "epsilon": eps, "delta": recipe["privacy"]["delta"],
        "target_epsilon": recipe["privacy"]["epsilon"], "ledger": ledger,
        "epsilon_over_steps": [(r["step"], r["epsilon"]) for r in rows],
        "plot": str(plot) if plot else None,
    }
