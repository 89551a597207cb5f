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


def test_set_overrides_a_string_algorithm():
    """Core fix: ``--set algorithm.KEY=VALUE`` when the recipe names the algorithm as a string."""
    from dpregistry import UserError
    from dpregistry.recipe import load

    recipe = load(RECIPES / "kl_adaptive_gd_diabetes.yaml", ["algorithm=adaptive_noisy_gd",
                                                            "algorithm.stop_on_floor=true"])
    assert recipe.data["algorithm"]["stop_on_floor"] is True
    spider = load(RECIPES / "kl_spider_pl.yaml", ["algorithm.calibration=paper"])
    assert spider.data["algorithm"]["calibration"] == "paper"
    with pytest.raises(UserError, match="calibration: paper"):
        make_run(RECIPES / "kl_spider_pl.yaml", sets=["algorithm.calibration=paper"])


def test_rho_budget_refusal_and_report(tmp_path):
    """Core fixes: a plan refused under a ρ-only budget names ρ (it raised a TypeError), and the
    privacy report of a ρ-budget run states the ρ spent."""
    from typer.testing import CliRunner

    from dpregistry import UserError
    from dpregistry.cli import app
    from dpregistry.report import privacy_report

    refused = {"algorithm": "dp_sgd", "objective": {"name": "quadratic", "dim": 3, "n": 500},
               "sampler": {"name": "full_batch"}, "privatizer": {"clip": 1.0, "noise_multiplier": 0.5},
               "accountant": "zcdp", "privacy": {"rho": 0.01}, "train": {"steps": 100}}
    # replace-one: Δ = 2C, σ = 0.5C, so each step costs (2C)²/(2(0.5C)²) = 8
    with pytest.raises(UserError, match=r"spends ρ = 800, more than the budget ρ = 0\.01"):
        make_run(refused, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    run = make_run(RECIPES / "kl_adaptive_gd_diabetes.yaml", out=out)
    summary = run.train()
    rep = privacy_report(out)
    assert rep["rho"] == summary["rho"] and rep["target_rho"] == 1.0 and rep["epsilon"] is None
    text = " ".join(CliRunner().invoke(app, ["privacy", "report", str(out)]).output.split())  # as one line
    assert f"ρ = {summary['rho']:.4g} of 1" in text
