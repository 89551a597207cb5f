"""benchmarks/grape_vs_opacus.py prints a largest-batch ratio as bounds and gives a verdict only when
the bounds settle it: every largest batch consistent with the runs must give a ratio inside them,
and the bounds must be reached (they are the tightest the runs allow)."""

import importlib.util
import itertools
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _batch_ratio():
    spec = importlib.util.spec_from_file_location("grape_vs_opacus", REPO / "benchmarks" / "grape_vs_opacus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.batch_ratio


def _consistent(fits: int, did_not: int | None, cap: int) -> range:
    """The largest batches consistent with 'fits fit, did_not did not' (unknown above when None)."""
    return range(fits, did_not if did_not is not None else cap)


def test_the_largest_batch_ratio_bounds_hold_every_consistent_truth_and_are_tight():
    batch_ratio = _batch_ratio()
    cap = 40  # stands in for "unbounded": the bounds must then be 0 or inf
    for ln, ld in itertools.product(range(1, 8), repeat=2):
        for hn, hd in itertools.product([None, *range(ln + 1, 12)], [None, *range(ld + 1, 12)]):
            low, high = batch_ratio((ln, hn), (ld, hd))
            truths = [a / b for a in _consistent(ln, hn, cap) for b in _consistent(ld, hd, cap)]
            assert all(low <= r <= high for r in truths)
            assert (low == 0.0) if hd is None else math.isclose(low, min(truths))
            assert (high == math.inf) if hn is None else math.isclose(high, max(truths))
