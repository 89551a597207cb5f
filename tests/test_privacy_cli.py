"""`dpreg privacy calibrate | epsilon | report`: outputs checked against the accountants, and the
report's files and content against the run it describes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import write_recipe
from dpregistry.cli import app
from dpregistry.privacy.accountant import Budget, make_accountant
from dpregistry.privacy.events import Gaussian, PoissonSampled
from dpregistry.stages import Charge

runner = CliRunner()


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.mark.parametrize("accountant,relation", [("rdp", "replace_one"), ("pld", "add_remove"), ("zcdp", "replace_one")])
def test_calibrate_and_epsilon_agree_with_the_accountants(accountant, relation):
    q, steps, eps, delta = 0.02, 500, 2.0, 1e-5
    code, out = invoke("privacy", "calibrate", "--epsilon", eps, "--delta", delta, "--steps", steps,
                       "--sample-rate", q, "--accountant", accountant, "--relation", relation, "--json")
    assert code == 0, out
    got = json.loads(out)
    sens = 2.0 if relation == "replace_one" else 1.0
    acc = make_accountant(accountant, Budget(eps, delta, relation=relation))

    def plan(z):
        return [Charge(PoissonSampled(q, Gaussian(std=z, sensitivity=sens)), count=steps)]

    assert got["noise_multiplier"] == pytest.approx(acc.calibrate(plan), rel=1e-12)
    assert got["epsilon"] <= eps and got["epsilon"] == pytest.approx(acc.epsilon(extra=plan(got["noise_multiplier"])))
    code, out = invoke("privacy", "epsilon", "--noise-multiplier", got["noise_multiplier"], "--steps", steps,
                       "--sample-rate", q, "--delta", delta, "--accountant", accountant, "--relation", relation,
                       "--json")
    assert code == 0 and json.loads(out)["epsilon"] == pytest.approx(got["epsilon"], rel=1e-12)
    code, out = invoke("privacy", "calibrate", "--epsilon", eps, "--delta", delta, "--steps", steps,
                       "--sample-rate", q, "--accountant", accountant, "--relation", relation)
    assert code == 0 and f"{got['noise_multiplier']:.6g}" in out


@pytest.mark.parametrize("args,message", [
    (["--epsilon", "-1"], "--epsilon must be positive"), (["--delta", "1.5"], "--delta must be in (0, 1)"),
    (["--sample-rate", "0"], "--sample-rate must be in (0, 1]"), (["--accountant", "prv"], "unknown accountant"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    base = {"--epsilon": "1", "--delta": "1e-5", "--steps": "10", "--sample-rate": "0.1"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    code, out = invoke("privacy", "calibrate", *[x for kv in base.items() for x in kv])
    assert code == 2 and message in out and len(out.strip().splitlines()) <= 2


def test_report_prints_the_ledger_and_writes_the_plot(tmp_path):
    import matplotlib.image

    r = {"algorithm": "dp_sgd", "objective": {"name": "quadratic", "dim": 3, "n": 400, "n_test": 10},
         "sampler": {"name": "poisson", "batch_size": 20}, "privatizer": {"clip": 1.0, "noise_multiplier": "auto"},
         "accountant": "rdp", "privacy": {"epsilon": 1.5, "delta": 1e-5},
         "train": {"steps": 24, "log_every": 4, "checkpoint_every": 12, "progress": False}}
    out = tmp_path / "run"
    code, text = invoke("run", write_recipe(tmp_path, r), "--out", out, "-q")
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    metrics = {m["step"]: m["epsilon"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    code, text = invoke("privacy", "report", out, "--points", 6)
    assert code == 0, text
    plot = out / "privacy_epsilon.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(plot)
    assert img.shape[0] > 200 and img.shape[1] > 300 and img[..., :3].std() > 0.05  # a drawn figure
    flat = " ".join(text.split())  # rich wraps long lines
    assert "accountant rdp (Rényi DP, replace-one), 24 charges over 24 steps" in flat
    assert f"ε = {summary['epsilon']:.4g} at δ = 1e-05 (budget 1.5)" in flat
    assert "0–23" in flat and "poisson(q=0.05" in flat
    assert str(plot) in "".join(text.split())

    code, text = invoke("privacy", "report", out, "--points", 6, "--json")
    rep = json.loads(text)
    assert rep["accountant"] == "rdp" and rep["charges"] == 24 and rep["step"] == 24
    assert rep["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    curve = dict(rep["spent_over_steps"])
    assert sorted(curve) == [4, 8, 12, 16, 20, 24]
    for step, eps in curve.items():  # recomputed from the ledger = what the engine logged
        assert eps == pytest.approx(metrics[step], rel=1e-12)
    assert rep["ledger"][0]["count"] == 24 and rep["ledger"][0]["event"]["type"] == "poisson_sampled"


def test_report_of_a_zcdp_run_without_delta_plots_rho(tmp_path):
    r = {"algorithm": "dp_sgd", "objective": {"name": "quadratic", "dim": 3, "n": 400, "n_test": 10},
         "sampler": {"name": "full_batch"}, "privatizer": {"clip": 1.0, "noise_multiplier": 10.0},
         "accountant": "zcdp", "privacy": {"rho": 0.5}, "train": {"steps": 8, "progress": False}}
    out = tmp_path / "run"
    assert invoke("run", write_recipe(tmp_path, r), "--out", out, "-q")[0] == 0
    code, text = invoke("privacy", "report", out, "--json")
    rep = json.loads(text)
    assert rep["spent_label"] == "ρ spent" and rep["epsilon"] is None
    assert rep["rho"] == pytest.approx(8 * 4 / (2 * 100)) and rep["target_rho"] == 0.5
    assert (out / "privacy_epsilon.png").exists()
    code, text = invoke("privacy", "report", tmp_path / "nothing")
    assert code == 2 and "run folder not found" in text
