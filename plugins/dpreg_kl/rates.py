"""Rate sweeps: excess empirical risk against n√ρ on the axis-design problems (spec 004 §5 D).

Used by ``benchmarks/kl_rates.py`` and by the reduced-grid rate test. Each point is a full run of a
registered preset through the engine (recipe → stages → ledger), so the sweep measures the shipped
code, not a re-implementation.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

MAX_N = 10_000_000  # above this n√ρ grows through ρ (every constant depends on n and ρ only via n√ρ)


def split(n_sqrt_rho: float, dim: int = 5, n: int | None = None) -> tuple[int, float]:
    """(n, ρ) with n√ρ = the target: n up to MAX_N (a multiple of dim) at ρ = 1, then ρ grows;
    or the given n, with ρ = (target/n)²."""
    n = (int(min(n_sqrt_rho, MAX_N)) if n is None else int(n)) // dim * dim
    return n, (n_sqrt_rho / n) ** 2


def run_point(algorithm: str, *, power: float, n_sqrt_rho: float, seed: int, dim: int = 5, n: int | None = None,
              algorithm_params: dict | None = None) -> dict[str, Any]:
    """One full run; returns its excess risk, releases and spent ρ."""
    from dpregistry.run import Run
    from dpregistry.recipe import resolve
    from dpregistry.registry import get_registry

    n, rho = split(n_sqrt_rho, dim, n)
    smoothness = (power - 1.0)  # on the unit ball around w* (radius 1)
    data = {"seed": seed, "algorithm": {"name": algorithm, **(algorithm_params or {})},
            "objective": {"name": "kl_power", "dim": dim, "n": n, "power": power},
            "privacy": {"rho": rho}, "train": {"steps": 10**8, "log_every": 10**8}}
    if algorithm == "adaptive_noisy_gd":
        data["update"] = {"name": "sgd", "lr": 1.0 / (2.0 * smoothness)}  # η = 1/(2L1)
    recipe = resolve(data, {}, get_registry(), source=f"<{algorithm} n√ρ={n_sqrt_rho:g} seed={seed}>")
    run = Run(recipe).prepare()
    summary = run.train()
    return {"excess": run.objective.excess_risk(), "steps": summary["step"], "rho": run.accountant.rho(),
            "budget": rho, "n": n, "n_sqrt_rho": n * math.sqrt(rho), "stopped": summary["stopped"],
            "phi_floor": getattr(getattr(run.algorithm, "sched", None), "phi_floor", None)}


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of log10 y against log10 x."""
    lx, ly = np.log10(np.asarray(xs, float)), np.log10(np.asarray(ys, float))
    return float(np.polyfit(lx, ly, 1)[0])


def sweep(algorithm: str, *, power: float, sizes, seeds, **kw) -> list[dict[str, Any]]:
    """Median excess risk over ``seeds`` at each n√ρ in ``sizes``."""
    out = []
    for size in sizes:
        runs = [run_point(algorithm, power=power, n_sqrt_rho=size, seed=s, **kw) for s in seeds]
        out.append({"n_sqrt_rho": size, "median_excess": statistics.median(r["excess"] for r in runs),
                    "runs": runs})
    return out
