"""The sample-complexity benchmark in its quick mode (excluded from the default run: -m benchmark)."""

from __future__ import annotations

import importlib.util
import math

import pytest

from conftest import REPO


@pytest.mark.benchmark
def test_quick_benchmark_prints_and_plots(tmp_path):
    spec = importlib.util.spec_from_file_location("bench", REPO / "benchmarks" / "nonsmooth_sample_complexity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick", "--out", str(tmp_path)])
    assert {r["method"] for r in rows} == {"ztc", "klt_zo", "klt_fo", "naive"}
    assert all(0 <= r["expected_certificate"] <= 1.5 and math.isclose(r["epsilon"], 4.0, rel_tol=1e-3) for r in rows)
    assert (tmp_path / "nonsmooth_certificate_quick.png").stat().st_size > 0
