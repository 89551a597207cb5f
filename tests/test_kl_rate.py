"""The rate of KL-Spider on the PL quadratic, on a reduced grid (the full sweep is benchmarks/kl_rates.py).

Theorem 1 gives excess risk Õ((√d/(n√ρ))^κ), so κ = 2 means a log-log slope near −2 against n√ρ
(spec §5 D1); the test asserts the median slope is steeper than −1.5. It runs the benchmark's
``sweep`` (the same runs, in this process).
"""

from __future__ import annotations

import importlib.util

from conftest import REPO


def test_kl_spider_pl_slope():
    spec = importlib.util.spec_from_file_location("kl_rates", REPO / "benchmarks" / "kl_rates.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # n from 10⁴: the run compares each step's full batch with the one it checked (a write through
    # .data keeps the version counter), about 10 ms a step at n = 10⁷ (slope −1.87 on this grid)
    sizes = [1e4, 1e5, 1e6]
    # d = 2 (γ² = d/2 = 1) keeps K, and the test, 2.5× shorter than the benchmark's d = 5
    points = bench.sweep("kl_spider", power=2.0, sizes=sizes, seeds=[0, 1, 2], dim=2)
    medians = [p["median_excess"] for p in points]
    slope = bench.loglog_slope(sizes, medians)
    print(f"KL-Spider on the PL quadratic: medians {medians}, slope {slope:.3f} (theory −2)")
    assert all(a > b for a, b in zip(medians, medians[1:]))
    for p in points:
        for r in p["runs"]:
            assert r["rho"] <= r["budget"] * (1 + 1e-12) and r["stopped"] is None
    assert slope < -1.5
