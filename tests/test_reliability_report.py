"""`dpreg report RUN_DIR`: PNG plots and a markdown summary, checked by content, not by eye."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from conftest import RECIPES, crash_at, make_run, write_recipe
from dpregistry import checkpoint as ckpt
from dpregistry.errors import UserError
from dpregistry.report import privacy_report
from dpregistry.folder import resume_run
from test_core_cli import dpreg

RECIPE = {
    "seed": 2,
    "description": "report test",
    "algorithm": "dp_adam",
    "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [16]}, "data": {"dataset": "wine"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 1.2},
    "update": {"lr": 0.01},
    "accountant": "rdp",
    "privacy": {"epsilon": 50.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 12, "log_every": 2, "eval_every": 4, "checkpoint_every": 4, "progress": False},
}


def table(md: str, heading: str) -> dict[str, str]:
    """The two-column table under ``## heading``."""
    section = md.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1).strip(): m.group(2).strip()
            for m in re.finditer(r"^\| ([^|]+) \| ([^|]+) \|$", section, re.M) if m.group(1).strip() not in
            ("quantity", "metric", "---")}


def num(text: str) -> float:
    return float(text)


def check_png(path):
    assert path.stat().st_size > 1000
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 300 and im.size[1] >= 200
        pixels = np.asarray(im.convert("RGB"))
    # a drawn plot: a white background, dark axes and text, and the coloured line
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7]}
    assert len(colours) > 20
    blue = (pixels[..., 2] > 150) & (pixels[..., 0] < 100)  # matplotlib's default line colour
    assert blue.sum() > 50


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    recipe = write_recipe(root, RECIPE)
    assert dpreg("run", recipe, "--out", root / "out", "-q").returncode == 0
    res = dpreg("report", root / "out")
    assert res.returncode == 0, res.stderr
    return root / "out", res


def test_report_writes_the_markdown_and_four_plots(finished):
    out, res = finished
    names = ["report.md", "overview.png", "loss.png", "eval.png", "epsilon.png"]
    assert sorted(p.name for p in (out / "report").iterdir()) == sorted(names)
    for n in names:
        assert str(out / "report" / n) in res.stdout
    for n in names[1:]:
        check_png(out / "report" / n)
        assert f"]({n})" in (out / "report" / "report.md").read_text()  # linked from the markdown
    # the overview comes first, right under the status line
    md = (out / "report" / "report.md").read_text()
    assert md.index("](overview.png)") < md.index("## Privacy")


def test_the_markdown_states_what_summary_json_holds(finished):
    out, _ = finished
    s = json.loads((out / "summary.json").read_text())
    md = (out / "report" / "report.md").read_text()
    assert md.startswith("# Run report: dp_adam\n") and "report test" in md
    assert f"Status: finished, {s['step']} steps." in md
    p = table(md, "Privacy")
    assert num(p["ε spent"]) == pytest.approx(s["epsilon"], rel=1e-5)
    assert num(p["target ε"]) == s["target_epsilon"] == 50.0
    assert num(p["δ"]) == s["delta"] == 1e-3
    assert p["accountant"] == s["accountant"] == "rdp" and p["neighbouring relation"] == s["relation"]
    assert num(p["noise multiplier"]) == pytest.approx(s["noise_multiplier"], rel=1e-5)
    assert int(p["steps"]) == s["step"] == 12 and p["noise"].endswith("(privacy.noise: reproducible)")
    assert "NOT a privacy guarantee" in p["noise"]
    m = table(md, "Held-out metrics (final)")
    assert set(m) == set(s["metrics"]) and s["metrics"]
    for k, v in s["metrics"].items():
        assert num(m[k]) == pytest.approx(v, rel=1e-5)
    assert "- steps 0–11: 12 × poisson(" in md  # the ledger
    assert f"recipe hash: `{s['recipe_hash']}`" in md and f"torch: {s['versions']['torch']}" in md


def test_the_report_of_an_interrupted_run_uses_its_newest_checkpoint(tmp_path):
    """(Reproducible noise evaluates between checkpoints: the held-out row of step 10 after the step-8
    checkpoint is what a crash leaves, not a sign of a cut ledger.)"""
    out = tmp_path / "out"
    crash_at(make_run({**RECIPE, "train": {**RECIPE["train"], "eval_every": 2}}, tmp_path, out=out), 10)
    assert any("eval/accuracy" in json.loads(x) and json.loads(x)["step"] == 10
               for x in (out / "metrics.jsonl").read_text().splitlines())
    assert dpreg("report", out).returncode == 0
    md = (out / "report" / "report.md").read_text()
    assert "Status: interrupted; the newest valid checkpoint is at step 8" in md
    expected = resume_run(out, warn=lambda m: None).epsilon()  # ε of the ledger at step 8
    assert num(table(md, "Privacy")["ε spent"]) == pytest.approx(expected, rel=1e-5)
    assert "Held-out metrics (final)" not in md  # no final metrics for an unfinished run
    for n in ("overview.png", "loss.png", "eval.png", "epsilon.png"):
        check_png(out / "report" / n)


def test_a_lost_final_checkpoint_does_not_lower_the_reported_epsilon(finished, tmp_path):
    """The reports read the newest valid checkpoint's ledger; with the last checkpoint deleted a
    review's finished run reported ε = 2.387 instead of 2.999, as "interrupted". ledger.jsonl's
    newer lines are what was spent; a ledger file that does not continue the checkpoint is refused."""
    import shutil

    out, _ = finished
    lost = tmp_path / "lost"
    shutil.copytree(out, lost)
    summary = json.loads((lost / "summary.json").read_text())
    newest = ckpt.list_checkpoints(lost / "checkpoints")[-1][1]
    newest.unlink()
    rep = privacy_report(lost, plot=False)
    assert rep["step"] == summary["step"] and rep["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-9)
    assert "ledger.jsonl records charges up to step" in rep["ledger_note"]
    assert dpreg("report", lost).returncode == 0
    md = (lost / "report" / "report.md").read_text()
    assert num(table(md, "Privacy")["ε spent"]) == pytest.approx(summary["epsilon"], rel=1e-5)
    lines = (lost / "ledger.jsonl").read_text().splitlines()
    (lost / "ledger.jsonl").write_text("\n".join(lines[:1]) + "\n")  # the chain cut: an edit
    with pytest.raises(UserError, match="summary.json records step 12, after the last charge"):  # the summary shows it
        privacy_report(lost, plot=False)


def test_metrics_of_the_training_data_are_not_called_held_out(tmp_path):
    """quadratic_dpzero's objective reports train_loss, the mean loss over every private training
    row, computed without noise: report.md listed it as a held-out metric."""
    out = tmp_path / "q"
    assert dpreg("run", RECIPES / "quadratic_dpzero.yaml", "--out", out, "--set", "train.steps=20", "-q").returncode == 0
    assert "train_loss" in json.loads((out / "summary.json").read_text())["metrics"]
    assert dpreg("report", out).returncode == 0
    md = (out / "report" / "report.md").read_text()
    held_out = md.split("## Held-out metrics (final)")[1].split("##")[0] if "## Held-out metrics" in md else ""
    assert "train_loss" not in held_out
    assert "train_loss" in md.split("not covered by the guarantee) (final)")[1].split("##")[0]


# ------------------------------------------------------------------------------------------
# plots read at a glance, checked on matplotlib's own artists
# ------------------------------------------------------------------------------------------


@pytest.fixture
def figures(monkeypatch):
    """write_report(run_dir) -> {file name: the drawn figure} instead of PNG files."""
    from matplotlib import pyplot as plt

    from dpregistry import report

    drawn = {}

    def keep(fig, path):
        fig.canvas.draw()
        drawn[path.name] = fig

    monkeypatch.setattr(report, "_save", keep)

    def build(run_dir):
        drawn.clear()
        report.write_report(run_dir)
        return dict(drawn)

    yield build
    plt.close("all")


def whole_steps(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def target_lines(ax, value):
    return [ln for ln in ax.get_lines() if ln.get_label().startswith("target")
            and set(ln.get_ydata()) == {value} and ln.get_linestyle() == "--"]


def test_plots_span_whole_steps_from_0_and_draw_the_epsilon_target(finished, figures):
    out, _ = finished
    figs = figures(out)
    assert set(figs) == {"overview.png", "loss.png", "eval.png", "epsilon.png"}
    for name, fig in figs.items():
        for ax in fig.axes:
            ticks = whole_steps(ax)
            assert len(ticks) >= 3 and all(t == int(t) for t in ticks), (name, ticks)  # no step 2.5
            lo, hi = ax.get_xlim()
            assert lo <= 0 and hi >= 12, name  # every panel spans the whole run, from step 0
            assert ax.get_xlabel() == "step"
    overview = figs["overview.png"].axes
    assert [ax.get_ylabel() for ax in overview] == ["training loss", "held-out accuracy", "ε spent"]
    for ax in (overview[2], figs["epsilon.png"].axes[0]):
        assert len(target_lines(ax, 50.0)) == 1  # the recipe's ε = 50, as a dashed line
        assert ax.get_ylim()[1] >= 50.0  # and within view
        (curve,) = [ln for ln in ax.get_lines() if not ln.get_label().startswith("target")]
        assert curve.get_xdata()[0] == 0 and curve.get_ydata()[0] == 0.0  # nothing spent before step 1


@pytest.mark.parametrize("steps", [2, 3, 15])
def test_a_short_run_has_whole_step_ticks(steps):
    """Left alone, matplotlib ticks 2 or 3 steps at halves, and 15 steps at 2.5, 7.5, 12.5."""
    from matplotlib import pyplot as plt

    from dpregistry.report import _figure

    fig = _figure([("loss", list(range(1, steps + 1)), [1.0] * steps)], "short", last_step=steps)
    fig.canvas.draw()
    ticks = whole_steps(fig.axes[0])
    plt.close(fig)
    assert ticks[0] == 0 and len(ticks) >= 3 and all(t == int(t) for t in ticks)


def test_the_evaluation_curve_starts_at_step_0_with_visible_points(tmp_path, figures):
    """Evaluated at the step-0 baseline and at the end: the held-out plot has two marked points,
    the first at step 0 (the zero-shot or untrained model), drawn inside axes that start at 0."""
    out = tmp_path / "out"
    recipe = {**RECIPE, "train": {**RECIPE["train"], "eval_every": 12}}
    make_run(recipe, tmp_path, out=out).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]  # logged like every other evaluation
    figs = figures(out)
    for ax in figs["eval.png"].axes + [figs["overview.png"].axes[1]]:
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [0, 12] and line.get_marker() == "o" and line.get_markersize() >= 4
        for step, value in zip(line.get_xdata(), line.get_ydata()):
            x, y = ax.transData.transform((step, value))
            box = ax.get_window_extent()
            assert box.x0 <= x < box.x1 and box.y0 < y < box.y1  # drawn inside the axes
        assert ax.get_xlim()[0] <= 0 and whole_steps(ax)[0] == 0


def test_a_reproducible_runs_plots_say_their_epsilon_is_no_guarantee(tmp_path, figures):
    """report.md said it in its noise row only; the ε plots and the overview now say it under their
    titles (a review); a run with secret noise does not."""
    from dpregistry.report import NO_GUARANTEE

    def titles(noise):
        out = tmp_path / noise
        recipe = write_recipe(tmp_path, {**RECIPE, "privacy": {**RECIPE["privacy"], "noise": noise}}, f"{noise}.yaml")
        assert dpreg("run", recipe, "--out", out, "-q").returncode == 0
        return {name: fig._suptitle.get_text() if fig._suptitle else " ".join(ax.get_title() for ax in fig.axes)
                for name, fig in figures(out).items()}

    said = NO_GUARANTEE.strip()
    reproducible, secure = titles("reproducible"), titles("secure")
    assert said in reproducible["epsilon.png"] and said in reproducible["overview.png"]
    assert not any(said in t for t in secure.values())


def test_the_epsilon_plot_is_recomputed_from_the_ledger_not_read_from_metrics(finished, figures, tmp_path):
    """The ε curves read metrics.jsonl, which has no checksum and which folders made before a fix keep
    (an ELS run's rows understated ε): rows scaled down by 10 were drawn as they stood."""
    import shutil

    out, _ = finished
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    rows = [json.loads(x) for x in (edited / "metrics.jsonl").read_text().splitlines()]
    assert any("epsilon" in r for r in rows)
    (edited / "metrics.jsonl").write_text("".join(
        json.dumps({**r, "epsilon": r["epsilon"] / 10} if "epsilon" in r else r) + "\n" for r in rows))
    expected = dict(privacy_report(out, plot=False)["epsilon_over_steps"])
    figs = figures(edited)
    for ax in (figs["overview.png"].axes[2], figs["epsilon.png"].axes[0]):
        (curve,) = [ln for ln in ax.get_lines() if not ln.get_label().startswith("target")]
        drawn = dict(zip(curve.get_xdata()[1:], curve.get_ydata()[1:]))
        assert drawn == pytest.approx(expected, rel=1e-12) and max(drawn) == 12
        assert drawn[12] == pytest.approx(json.loads((out / "summary.json").read_text())["epsilon"], rel=1e-6)
