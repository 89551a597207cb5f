"""The rate of KL-Spider on the PL quadratic, on a reduced grid (the full sweep is benchmarks/kl_rates.py).

Theorem 1 gives excess risk Õ((√d/(n√ρ))^κ), so κ = 2 means a log-log slope near −2 against n√ρ
(spec §5 D1); the test asserts the median slope is steeper than −1.5.
"""

from __future__ import annotations

from dpreg_kl.rates import loglog_slope, sweep


def test_kl_spider_pl_slope():
    sizes = [1e5, 1e6, 1e7]
    # d = 2 (γ² = d/2 = 1) keeps K, and the test, 2.5× shorter than the benchmark's d = 5
    points = sweep("kl_spider", power=2.0, sizes=sizes, seeds=[0, 1, 2], dim=2)
    medians = [p["median_excess"] for p in points]
    slope = loglog_slope(sizes, medians)
    print(f"KL-Spider on the PL quadratic: medians {medians}, slope {slope:.3f} (theory −2)")
    assert all(a > b for a, b in zip(medians, medians[1:]))
    for p in points:
        for r in p["runs"]:
            assert r["rho"] <= r["budget"] * (1 + 1e-12) and r["stopped"] is None
    assert slope < -1.5
