"""A run folder as someone else may hand it over (review 19): rows that show releases past the
last charge, another run's checkpoint, links where files should be, files no run writes, and
numbers no run logs. Each is refused in one line, and nothing outside the folder is touched."""

from __future__ import annotations

import json
import os

import pytest

from conftest import RECIPES, make_run
from dpregistry import checkpoint as ckpt
from dpregistry.errors import UserError
from dpregistry.folder import resume_run
from dpregistry.ledger_file import LedgerFile
from dpregistry.report import privacy_report
from test_core_cli import dpreg
from test_reliability_ledger import RECIPE, finished, newest


def cut_to(out, step):
    """What removing the checkpoints after ``step`` and the ledger lines that record them leaves."""
    for at, path in ckpt.list_checkpoints(out / "checkpoints"):
        if at > step:
            path.unlink()
    kept = [line for line in (out / "ledger.jsonl").read_text().splitlines(keepends=True)
            if json.loads(line)["step"] <= step]
    (out / "ledger.jsonl").write_text("".join(kept))


def test_the_rows_of_an_algorithm_that_logs_its_releases_show_a_cut(tmp_path):
    """Adaptive noisy GD logs the norm it released and the σ it chose from it in every row (each
    row follows a checkpoint of its step). With the last checkpoints and ledger lines removed,
    and no summary or model yet (a run killed at its last step), a secure resume took the steps
    again with fresh noise, released their norms a second time, and ended over its ρ budget."""
    out = tmp_path / "kl"
    make_run(RECIPES / "kl_adaptive_gd_diabetes.yaml", tmp_path, out=out,
             sets=["train.steps=8", "train.log_every=1", "train.checkpoint_every=4", "train.keep_checkpoints=10",
                   "train.progress=false", "privacy.rho=50"]).train()
    (out / "summary.json").unlink()
    (out / "model.safetensors").unlink()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    cut_to(out, 4)
    assert max(r["step"] for r in rows) > 4
    said = f"metrics.jsonl holds a row of step {max(r['step'] for r in rows)}, whose metrics are functions of its releases"
    with pytest.raises(UserError, match=said):
        resume_run(out)
    with pytest.raises(UserError, match=said):
        privacy_report(out, plot=False)


def test_the_reports_refuse_another_runs_checkpoint(tmp_path):
    """The reports read ε from the newest valid checkpoint without comparing it with ledger.jsonl
    or recipe.json: another run's checkpoint (a budget of 0.5 against 50) put in the folder made
    them print its ε. dpreg resume and export already refused it."""
    ours = finished(tmp_path)
    theirs = finished(tmp_path, dict(RECIPE, privacy=dict(RECIPE["privacy"], epsilon=0.5),
                                     privatizer={"clip": 1.0, "noise_multiplier": 20.0}), name="theirs")
    true_eps = privacy_report(ours, plot=False)["epsilon"]
    newest(ours).unlink()
    (ours / "checkpoints" / newest(theirs).name).write_bytes(newest(theirs).read_bytes())  # the same step, 12
    with pytest.raises(UserError, match="not this run's"):
        privacy_report(ours, plot=False)
    res = dpreg("report", ours)
    assert res.returncode == 2 and "not this run's" in res.stderr
    assert privacy_report(theirs, plot=False)["epsilon"] < true_eps  # what would have been printed


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    """`.lock` was opened through a symbolic link, truncated and written with the lock record: a
    folder handed over could make whoever resumed it overwrite any file they can write."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious user data\n")
    out = finished(tmp_path)
    (out / ".lock").unlink(missing_ok=True)
    os.symlink(victim, out / ".lock")
    res = dpreg("resume", out, "-q")
    assert res.returncode == 2 and "symbolic link" in res.stderr and "\n" not in res.stderr.strip()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    os.symlink(victim, fresh / ".lock")
    res = dpreg("run", "quickstart", "--out", fresh, "-q", "--set", "train.steps=2")
    assert res.returncode == 2 and "\n" not in res.stderr.strip()
    assert victim.read_text() == "precious user data\n"


@pytest.mark.parametrize("folder", ["thesis", "report"])
def test_overwrite_replaces_a_run_folder_only(folder, tmp_path):
    """--overwrite emptied any folder it was given (a home folder's thesis and keys went); then,
    review 20, one whose entries only bore run names (report/thesis.tex)."""
    home = tmp_path / "home"
    (home / folder).mkdir(parents=True)
    (home / folder / "chapter1.tex").write_text("...")
    res = dpreg("run", "quickstart", "--out", home, "--overwrite", "-q", "--set", "train.steps=2")
    assert res.returncode == 2 and f"holds other files too ({folder})" in res.stderr
    assert (home / folder / "chapter1.tex").read_text() == "..."
    out = finished(tmp_path)  # a run folder is replaced
    res = dpreg("run", "quickstart", "--out", out, "--overwrite", "-q", "--set", "train.steps=2")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["step"] == 2


def test_metric_rows_without_a_whole_step_are_skipped(tmp_path):
    """A row whose step was null, a text or a list crashed resume and report with a TypeError, and a
    row without one crashed the report with a KeyError."""
    out = finished(tmp_path, dict(RECIPE, privacy=dict(RECIPE["privacy"], noise="reproducible")))
    with open(out / "metrics.jsonl", "a") as f:
        for row in ({"step": None}, {"step": "5"}, {"step": [3]}, {"step": True}, {"loss": 1.0}):
            f.write(json.dumps(row) + "\n")
    for command in (("report", out), ("resume", out, "-q")):
        res = dpreg(*command)
        assert res.returncode == 0, res.stderr


def test_a_run_file_larger_than_a_run_writes_is_refused_unread(tmp_path):
    """metrics.jsonl, ledger.jsonl, recipe.json and summary.json were read whole: a 3 GB one ran
    the resume and the reports out of memory (a MemoryError traceback)."""
    for name in ("metrics.jsonl", "ledger.jsonl", "summary.json", "recipe.json"):
        out = finished(tmp_path, name=name.replace(".", "_"))
        with open(out / name, "r+b") as f:
            f.truncate((1 << 30) + 1)  # sparse: nothing is written
        for command in (("resume", out, "-q"), ("privacy", "report", out)):
            res = dpreg(*command)
            assert res.returncode == 2 and "is larger than" in res.stderr and "\n" not in res.stderr.strip(), \
                (name, command, res.stderr[-500:])


def test_a_clip_whose_sensitivity_overflows_is_a_one_line_error():
    res = dpreg("validate", "quickstart", "--set", "privatizer.clip=1e308")
    assert res.returncode == 2 and "out of range" in res.stderr and "\n" not in res.stderr.strip()


def test_the_reports_and_the_card_state_the_unit_the_recipe_says(tmp_path):
    """summary.json has no checksum: edited to say "one user" under add/remove, an example-level
    replace-one run's privacy report and model card stated that wider guarantee."""
    from dpregistry.export import checked_guarantee
    from dpregistry.report import unit_line

    out = finished(tmp_path, dict(RECIPE, privacy=dict(RECIPE["privacy"], noise="secure")))
    summary = json.loads((out / "summary.json").read_text())
    summary.update(unit="user", users=50, max_examples_per_user=1, user_mechanism="uls", relation="add_remove")
    (out / "summary.json").write_text(json.dumps(summary))
    line = unit_line(privacy_report(out, plot=False))
    assert line.startswith("one example: the guarantee holds for replacing one training example")
    _, meta, _ = ckpt.latest_valid(out / "checkpoints")
    stated = checked_guarantee(out, summary, json.loads((out / "recipe.json").read_text())["recipe"], meta, "approx_dp")
    assert stated["unit"] == "example" and stated["relation"] == "replace_one"
    assert stated["unit_statement"].startswith("one example: the guarantee holds for replacing")
    assert LedgerFile(out).last["step"] == 12


def test_the_report_states_the_example_level_epsilon_of_an_els_run_from_its_ledger(tmp_path):
    """Group privacy reads the example-level ε: the report's unit line took it from summary.json."""
    import torch

    import dpregistry

    torch.manual_seed(0)
    x, y = torch.randn(240, 4), torch.randint(0, 2, (240,))
    recipe = {"algorithm": "dp_sgd", "sampler": {"name": "poisson", "batch_size": 30}, "update": {"lr": 0.1},
              "privacy": {"epsilon": 4.0, "delta": 1e-3, "unit": "user", "max_examples_per_user": 6},
              "train": {"steps": 4, "progress": False}}
    r = dpregistry.train(recipe, model=torch.nn.Linear(4, 2), train_data=list(zip(x, y)), users=torch.arange(240) // 12,
                         loss=lambda out, t: torch.nn.functional.cross_entropy(out, t, reduction="none"),
                         out=tmp_path / "els", verbose=False)
    true = r.summary["example_level"]["epsilon"]
    summary = json.loads((tmp_path / "els" / "summary.json").read_text())
    summary["example_level"]["epsilon"] = true / 10
    (tmp_path / "els" / "summary.json").write_text(json.dumps(summary))
    rep = privacy_report(tmp_path / "els", plot=False)
    assert rep["example_level"]["epsilon"] == pytest.approx(true, rel=1e-9)
    from dpregistry.report import unit_line

    assert f"example-level ε = {true:.4g}" in unit_line(rep)


def test_a_linked_checkpoints_folder_is_refused(tmp_path):
    """Review 20: O_NOFOLLOW guards the last name only; a resume wrote its checkpoints into (and
    deleted temporary files from) the folder a `checkpoints` link named."""
    import shutil

    out = finished(tmp_path)
    victim = tmp_path / "victim"
    shutil.move(out / "checkpoints", victim)
    (victim / ".notes.tmp").write_text("mine")
    os.symlink(victim, out / "checkpoints")
    res = dpreg("resume", out, "-q")
    assert res.returncode == 2 and "checkpoints/ is a symbolic link" in res.stderr
    assert (victim / ".notes.tmp").read_text() == "mine"
    res = dpreg("report", out)
    assert res.returncode == 2 and "symbolic link" in res.stderr


def test_a_reproducible_replay_interrupted_between_recorded_steps_resumes_and_reports(tmp_path):
    """Review 20: a checkpoint written by a replay between two recorded steps (the newest lost, a
    resume stopped on its way back) fits the ledger file, yet resume and the reports refused it."""
    from dpregistry.ledger_file import LedgerFile

    out = finished(tmp_path)  # reproducible noise, checkpoints at 0, 4, 8, 12
    full = LedgerFile(out).last
    for at, path in ckpt.list_checkpoints(out / "checkpoints"):
        if at > 4:
            path.unlink()
    run = resume_run(out)
    run.recipe.train.steps = 6  # what a signal at step 6 leaves: the replay's checkpoint at 6
    run.train()
    assert max(at for at, _ in ckpt.list_checkpoints(out / "checkpoints")) == 6
    assert LedgerFile(out).last == full  # the file records up to 12, not 6
    assert privacy_report(out, plot=False)["step"] == 12
    assert resume_run(out).step == 6


def test_an_overflowing_clip_of_adaptive_noisy_gd_is_a_one_line_error():
    """Review 20: the KL schedule computed its constants from an infinite sensitivity in the loop."""
    res = dpreg("validate", "kl_adaptive_gd_diabetes", "--set", "privatizer.clip=1e308")
    assert res.returncode == 2 and "privatizer.clip" in res.stderr and "\n" not in res.stderr.strip()
