"""Every shipped KL recipe validates through the CLI and runs within its ρ, cost table included."""

from __future__ import annotations

import pytest

from conftest import RECIPES, make_run
from dpreg_kl.report import cost_table, format_table

KL_RECIPES = sorted(RECIPES.glob("kl_*.yaml"))


def test_there_is_a_recipe_per_algorithm():
    algorithms = {p.read_text().split("name: ", 1)[1].split(None, 1)[0].strip(",}") for p in KL_RECIPES}
    assert {"kl_spider", "kl_proximal_point", "adaptive_noisy_gd"} <= algorithms
    assert any("zo_two_point" in p.read_text() for p in KL_RECIPES)  # the mixed recipe


@pytest.mark.parametrize("path", KL_RECIPES, ids=lambda p: p.stem)
def test_cli_validates(path):
    from typer.testing import CliRunner

    from dpregistry.cli import app

    out = CliRunner().invoke(app, ["validate", str(path)])
    assert out.exit_code == 0, out.output


@pytest.mark.parametrize("path", KL_RECIPES, ids=lambda p: p.stem)
def test_recipe_runs_within_rho(path):
    run = make_run(path)
    summary = run.train()
    rho = run.budget.rho
    rows = cost_table(run.accountant.ledger.to_json())
    total = sum(r["rho"] for r in rows)
    print(f"\n{path.stem}: {summary['step']} releases, metrics {summary['metrics']}")
    print(format_table(rows, rho, limit=5))
    assert summary["step"] > 0 and "train_excess_risk" in summary["metrics"]
    assert total == pytest.approx(summary["rho"], rel=1e-12) and total <= rho * (1 + 1e-12)
