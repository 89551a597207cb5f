"""Privacy invariants under injected faults, and storage faults.

* A step that fails halfway (an exception in the forward pass, out of memory, a failing
  accountant) is not applied; one that fails after its charge stays charged. No step is ever
  applied without its charge, for every registered algorithm.
* NaN/inf losses or gradients injected into some examples are zeroed before clipping (the clipped
  sum equals that of the batch without them), counted, and stop the run after
  train.max_nonfinite_steps such steps.
* A full disk (the kernel's ENOSPC from /dev/full, and a real full tmpfs where mounting is allowed)
  and an unwritable folder (an immutable directory) give one clear line, keep the last good
  checkpoint, and `dpreg resume` then finishes bit-identically.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import RECIPES, make_run, write_recipe
from dpregistry import checkpoint as ckpt
from dpregistry import files
from dpregistry.folder import resume_run
from dpregistry.errors import UserError
from test_core_cli import dpreg

FAULTS = {"injected": 0}  # counted by the tests below, printed at the end

RECIPE = {
    "seed": 3,
    "algorithm": "dp_adam",
    "objective": {"name": "tabular", "model": {"kind": "mlp", "hidden": [32]}, "data": {"dataset": "wine"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 1.2},
    "update": {"lr": 0.01},
    "accountant": "rdp",
    "privacy": {"epsilon": 50.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 10, "log_every": 2, "checkpoint_every": 2, "keep_checkpoints": 3, "progress": False},
}
ZO = dict(RECIPE, algorithm="standard", estimator={"name": "zo_two_point", "lambda": 1e-3},
          privatizer={"name": "gaussian", "clip": 2.0, "noise_multiplier": 1.2},
          update={"name": "directional_sgd", "lr": 1e-3})


def params_of(run):
    return {k: v.detach().clone() for k, v in run.params.items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def close(a, b, atol=1e-6):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted CLI run of RECIPE."""
    root = tmp_path_factory.mktemp("ref")
    recipe = write_recipe(root, RECIPE)
    assert dpreg("run", recipe, "--out", root / "out", "-q").returncode == 0
    return recipe, root / "out"


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert same(ma, mb)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["epsilon"] == sb["epsilon"] and sa["step"] == sb["step"]


# ---------------------------------------------------------------------------------------------
# a step that fails halfway
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [RECIPE, ZO], ids=["first_order", "zeroth_order"])
@pytest.mark.parametrize("fault", [Injected("forward pass"), torch.OutOfMemoryError("injected OOM")],
                         ids=["exception", "out_of_memory"])
def test_a_forward_pass_that_fails_leaves_no_trace(recipe, fault, tmp_path):
    run = make_run(recipe, tmp_path)
    for _ in range(2):  # two good steps, then the fault in the third
        run.begin_step()
        run.algorithm.step(run)
        run.step += 1
    before, charges = params_of(run), run.accountant.ledger.n_charges
    real, calls = run.objective.batch_losses, {"n": 0}

    def fails_in_the_second_pass(idx):
        calls["n"] += 1
        if calls["n"] == 2:  # first order: the second micro-batch; zeroth order: x − λu
            raise fault
        return real(idx)

    run.objective.batch_losses = fails_in_the_second_pass
    run.recipe.train.micro_batch_size = 4
    with pytest.raises((Injected, UserError)) as e:
        run.train()
    FAULTS["injected"] += 1
    if isinstance(fault, torch.OutOfMemoryError):
        assert "out of memory in step 2" in str(e.value) and e.value.key == "train.micro_batch_size"
    assert run.step == 2 and run.accountant.ledger.n_charges == charges  # not charged
    assert (same if recipe is RECIPE else close)(params_of(run), before)  # not applied


def test_out_of_memory_in_the_cli_is_one_line_and_resume_finishes(reference, tmp_path, monkeypatch):
    from dpreg_baseline.objectives import TabularObjective

    from conftest import setup_probes

    recipe, ref_out = reference
    real, calls, probing = TabularObjective.batch_losses, {"n": 0}, setup_probes(monkeypatch)

    def oom_at_the_seventh_step(self, idx):
        calls["n"] += not probing  # the estimator's model checks at setup are no step's
        if calls["n"] == 7 and not probing:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, idx)

    monkeypatch.setattr(TabularObjective, "batch_losses", oom_at_the_seventh_step)
    out = tmp_path / "out"
    res = dpreg("run", recipe, "--out", out, "-q")
    FAULTS["injected"] += 1
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "out of memory in step 6" in res.stderr and "train.micro_batch_size" in res.stderr
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")][-1] == 6 - 6 % 2
    monkeypatch.setattr(TabularObjective, "batch_losses", real)
    assert dpreg("resume", out, "-q").returncode == 0
    assert_same_run(ref_out, out)


def test_a_step_that_fails_after_its_charge_stays_charged(tmp_path):
    run = make_run(RECIPE, tmp_path)
    before = params_of(run)

    def update_fails(params, release, r):
        raise Injected("after the charge, before the update")

    run.update_rule.apply = update_fails
    with pytest.raises(Injected):
        run.train()
    FAULTS["injected"] += 1
    assert run.accountant.ledger.n_charges == 1  # the release was computed: it is paid for
    assert same(params_of(run), before)  # and it was not applied


def test_a_resume_after_a_failed_update_redoes_the_step_identically(reference, tmp_path, monkeypatch):
    """The failed step never reached the disk: the resumed run redoes it and matches bit for bit."""
    from dpreg_baseline.updates import Adam

    recipe, ref_out = reference
    real, calls = Adam.apply, {"n": 0}

    def fails_in_step_5(self, params, release, run):
        calls["n"] += 1
        if calls["n"] == 6:
            raise Injected("update rule")
        return real(self, params, release, run)

    monkeypatch.setattr(Adam, "apply", fails_in_step_5)
    out = tmp_path / "out"
    with pytest.raises(Injected):
        dpreg("run", recipe, "--out", out, "-q")
    FAULTS["injected"] += 1
    _, meta, _ = ckpt.latest_valid(out / "checkpoints")
    assert meta["step"] == 4 and sum(e["count"] for e in meta["ledger"]) == 4
    monkeypatch.setattr(Adam, "apply", real)
    assert dpreg("resume", out, "-q").returncode == 0
    assert_same_run(ref_out, out)


def _algorithm_recipe(name: str):
    """A small recipe for any registered algorithm: its preset with a small objective."""
    from dpregistry.run import Run
    from dpregistry.recipe import load

    base = {"seed": 1, "algorithm": name, "privacy": {"epsilon": 200.0, "delta": 1e-3},
            "train": {"steps": 3, "progress": False}}
    objectives = [{"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
                  {"name": "quadratic", "dim": 8, "n": 200}]
    standard = {"sampler": {"name": "poisson", "batch_size": 16}, "estimator": "per_example_grad",
                "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 2.0}, "update": {"name": "sgd", "lr": 0.1},
                "accountant": "rdp"}
    errors = []
    for obj in objectives:
        for extra in ({}, standard):
            recipe = {**base, **extra, "objective": obj}
            return_path = None
            try:
                import tempfile

                with tempfile.TemporaryDirectory() as d:
                    return_path = write_recipe(Path(d), recipe)
                    Run(load(return_path)).prepare()
                return recipe
            except UserError as e:
                errors.append(str(e))
    # an algorithm whose stages need their own objective: its shipped recipe, shortened
    import yaml

    for path in sorted(RECIPES.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        alg = raw.get("algorithm")
        if (alg.get("name") if isinstance(alg, dict) else alg) != name:
            continue
        sets = ["train.steps=3", "train.progress=false"]
        try:
            Run(load(path, sets)).prepare()
            return path, sets
        except UserError as e:
            errors.append(str(e))
    return errors


def registered_algorithms():
    from dpregistry.registry import get_registry

    return sorted(get_registry().entries["algorithm"])


@pytest.mark.parametrize("name", registered_algorithms())
def test_no_algorithm_applies_a_step_without_its_charge(name, tmp_path):
    """For every registered algorithm (plugins included, as they land): if the charge fails, the
    step's release is not applied; if the update fails, the charge stays."""
    recipe = _algorithm_recipe(name)
    if isinstance(recipe, list):
        pytest.fail(f"no small recipe fits algorithm {name!r}: {recipe[-1]}")
    run = make_run(recipe[0], tmp_path, sets=recipe[1]) if isinstance(recipe, tuple) else make_run(recipe, tmp_path)
    run.begin_step()
    run.algorithm.step(run)  # one good step (stateful algorithms get past their first-step setup)
    run.ctx.undo_displacement()
    run.step += 1
    before, charges = params_of(run), run.accountant.ledger.n_charges

    def refuse(*a, **k):
        raise Injected("the accountant failed")

    run.accountant.charge = refuse
    with pytest.raises(Injected):
        run.train()
    FAULTS["injected"] += 1
    assert run.step == 1 and run.accountant.ledger.n_charges == charges
    assert close(params_of(run), before), f"{name} applied a release whose charge failed"


# ---------------------------------------------------------------------------------------------
# non-finite losses and gradients
# ---------------------------------------------------------------------------------------------


def poison(run, mode: str, every: int = 5):
    """Make the loss (mode "loss") or only the gradient (mode "grad") of records i ≡ 0 mod ``every``
    NaN or inf; the other records are untouched."""
    real = run.objective.batch_losses

    def poisoned(idx):
        losses = real(idx)
        bad = (idx % every == 0).to(losses.device)
        if mode == "loss":
            nan_or_inf = torch.where(idx % (2 * every) == 0, float("nan"), float("inf")).to(losses.dtype)
            return torch.where(bad, nan_or_inf, losses)
        # finite loss, NaN gradient: d√u/du = inf at u = 0, times 0, only in the bad rows (indexed,
        # since torch.where would send 0·inf = NaN into the good rows' gradients too)
        extra = torch.zeros_like(losses)
        extra[bad] = torch.sqrt(losses[bad] * 0)
        return losses + extra

    run.objective.batch_losses = poisoned
    return real


@pytest.mark.parametrize("recipe, mode", [(RECIPE, "loss"), (RECIPE, "grad"), (ZO, "loss")],
                         ids=["first_order-loss", "first_order-gradient", "zeroth_order-loss"])
def test_nonfinite_examples_are_zeroed_before_clipping(recipe, mode, tmp_path):
    run = make_run(recipe, tmp_path)
    idx = run.sampler.indices(run.ctx)
    clean_idx = idx[idx % 5 != 0]
    assert len(clean_idx) < len(idx)
    x0 = params_of(run)

    def privatize(indices):
        total = run.privatize_batch(indices)
        run.ctx.take_displacement()
        with torch.no_grad():  # back to exactly x (undoing x − λu in floats is only close)
            for k, v in run.params.items():
                v.copy_(x0[k])
        return total

    clean = privatize(clean_idx)
    poison(run, mode)
    dirty = privatize(idx)
    FAULTS["injected"] += 1
    assert dirty.nonfinite == len(idx) - len(clean_idx) and dirty.count == len(idx)
    a, b = dirty.aggregate.tensors, clean.aggregate.tensors
    assert all(torch.isfinite(t).all() for t in a.values())
    # the poisoned records contribute exactly nothing (sums in another order: equal to rounding)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in b)


def test_nonfinite_steps_are_counted_and_stop_the_run(tmp_path):
    out = tmp_path / "out"
    run = make_run(dict(RECIPE, train=dict(RECIPE["train"], max_nonfinite_steps=3, log_every=1)), tmp_path, out=out)
    poison(run, "grad", every=3)  # a Poisson batch of ~16 of 142 records: almost surely one bad
    summary = run.train()
    FAULTS["injected"] += 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    bad_steps = [r["step"] for r in rows if r["nonfinite"] > 0]
    assert bad_steps == [1, 2, 3, 4] and summary["step"] == 4  # stopped after the 4th bad step
    assert "non-finite" in summary["stopped"] and "max_nonfinite_steps = 3" in summary["stopped"]
    assert all(torch.isfinite(v).all() for v in run.params.values())
    _, meta, _ = ckpt.latest_valid(out / "checkpoints")
    assert meta["step"] == summary["step"] and meta["nonfinite_steps"] == 4


def test_by_default_a_record_with_a_nan_loss_does_not_decide_when_the_run_stops():
    """The run stopped after 10 steps with non-finite examples by default: a count of the private
    batch, without noise. With one record's features NaN a full-batch run stopped after 11 of its
    steps, and without it ran them all, so the step count, the model and the ε told the two
    neighbouring data sets apart (review 24). The stop is opt-in now."""
    import dpregistry

    def run(nan: bool):
        torch.manual_seed(0)
        x, y = torch.randn(200, 5), torch.randn(200)
        if nan:
            x[7] = float("nan")
        recipe = {"algorithm": "dp_sgd", "sampler": {"name": "full_batch"}, "privatizer": {"clip": 1.0},
                  "update": {"lr": 1e-3}, "privacy": {"epsilon": 3.0, "delta": 1e-5}, "train": {"steps": 15}}
        return dpregistry.train(recipe, model=torch.nn.Linear(5, 1), loss=lambda o, t: (o.squeeze(1) - t) ** 2,
                                train_data=torch.utils.data.TensorDataset(x, y), verbose=False).summary

    with_nan, without = run(True), run(False)
    assert with_nan["step"] == without["step"] == 15 and with_nan["stopped"] is None
    assert with_nan["epsilon"] == without["epsilon"]


def test_a_run_stopped_at_its_opt_in_nonfinite_limit_states_no_guarantee(tmp_path, monkeypatch):
    """When such a run stopped depends on a count of the private batch, without noise: its summary,
    its privacy report and its model card say that its ε is no guarantee, and why."""
    from dpreg_baseline.objectives import TabularObjective

    from dpregistry.report import privacy_report

    real = TabularObjective.batch_losses
    monkeypatch.setattr(TabularObjective, "batch_losses", lambda self, idx: real(self, idx) * float("nan"))
    out = tmp_path / "out"
    secure = dict(RECIPE, privacy={"epsilon": 50.0, "delta": 1e-3},
                  train=dict(RECIPE["train"], max_nonfinite_steps=1))
    summary = make_run(secure, tmp_path, out=out).train()
    assert summary["step"] == 2 and summary["private_stop"] is True and summary["guarantee"] is False
    assert "which the guarantee does not cover" in summary["stopped"]
    assert privacy_report(out, plot=False)["guarantee"] is False
    from dpregistry.export import _privacy_section, checked_guarantee  # the card's section (tabular has no card)

    _, meta, _ = ckpt.latest_valid(out / "checkpoints")
    card = "\n".join(_privacy_section(checked_guarantee(out, summary, meta["recipe"], meta, "rdp")))
    assert "NOT a privacy guarantee.** The run stopped on a count of the private batch" in card


def test_the_cli_reports_a_nonfinite_stop_in_one_line(tmp_path, monkeypatch):
    from dpreg_baseline.objectives import TabularObjective

    real = TabularObjective.batch_losses

    def all_nan(self, idx):
        return real(self, idx) * float("nan")

    monkeypatch.setattr(TabularObjective, "batch_losses", all_nan)
    recipe = write_recipe(tmp_path, dict(RECIPE, train=dict(RECIPE["train"], max_nonfinite_steps=0)))
    res = dpreg("run", recipe, "--out", tmp_path / "out", "-q")
    FAULTS["injected"] += 1
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "non-finite" in res.stderr and "max_nonfinite_steps = 0" in res.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["step"] == 1 and "non-finite" in s["stopped"]


# ---------------------------------------------------------------------------------------------
# storage: full disk, unwritable folder
# ---------------------------------------------------------------------------------------------


def full_disk_at(monkeypatch, path: Path) -> None:
    """The kernel's ENOSPC for writes to ``path``: it opens /dev/full (a link to it is refused)."""
    real = files.no_follow

    def opener(p, flags, mode=0o644):
        return os.open("/dev/full", os.O_WRONLY) if Path(p) == path else real(p, flags, mode)

    monkeypatch.setattr(files, "no_follow", opener)


def test_a_full_disk_at_a_checkpoint_is_one_clear_line_and_keeps_the_last_one(reference, tmp_path, monkeypatch):
    """The kernel's ENOSPC: the temporary file of the step-6 checkpoint is /dev/full."""
    recipe, ref_out = reference
    out = tmp_path / "out"
    real = files.no_follow
    full_disk_at(monkeypatch, files.temp_path(ckpt.checkpoint_path(out / "checkpoints", 6)))
    res = dpreg("run", recipe, "--out", out, "-q")
    monkeypatch.setattr(files, "no_follow", real)
    FAULTS["injected"] += 1
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "No space left on device" in res.stderr and "last good checkpoint (step 4) is kept" in res.stderr
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [0, 2, 4]
    assert not crashkit_temps(out)  # the failed write left nothing behind
    for _, p in ckpt.list_checkpoints(out / "checkpoints"):
        ckpt.read(p)
    assert dpreg("resume", out, "-q").returncode == 0
    assert_same_run(ref_out, out)


def crashkit_temps(out: Path) -> list[str]:
    return [p.name for p in (out / "checkpoints").iterdir() if files.TEMP.match(p.name)]


def test_a_full_disk_while_logging_is_one_clear_line(tmp_path, monkeypatch):
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)

    def disk_fills_at_step_5(r, metrics):
        if r.step == 5:
            full_disk_at(monkeypatch, out / "metrics.jsonl")

    with pytest.raises(UserError) as e:
        run.train(progress=disk_fills_at_step_5)
    FAULTS["injected"] += 1
    assert "No space left on device" in str(e.value) and "last good checkpoint (step 4) is kept" in str(e.value)
    assert ckpt.latest_valid(out / "checkpoints")[1]["step"] == 4


@contextmanager
def immutable(path: Path):
    """Make ``path`` unwritable even for root (chattr +i); skip where the file system refuses."""
    res = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if res.returncode:
        pytest.skip(f"chattr +i is not available here: {res.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_unwritable_output_folder_is_refused_and_nothing_is_written(reference, tmp_path):
    recipe, _ = reference
    out = tmp_path / "locked"
    out.mkdir()
    with immutable(out):
        res = dpreg("run", recipe, "--out", out, "-q")
        FAULTS["injected"] += 1
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "cannot write to the output folder (Operation not permitted)" in res.stderr
        assert list(out.iterdir()) == []


def test_a_folder_that_becomes_unwritable_mid_run_keeps_the_last_checkpoint(reference, tmp_path):
    recipe, ref_out = reference
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)
    folder = out / "checkpoints"
    state = {}

    def lock_at_step_5(r, metrics):
        if r.step == 5 and not state:
            state["cm"] = immutable(folder)
            state["cm"].__enter__()

    try:
        with pytest.raises(UserError) as e:
            run.train(progress=lock_at_step_5)
    finally:
        if state:
            state["cm"].__exit__(None, None, None)
    FAULTS["injected"] += 1
    assert "Operation not permitted" in str(e.value) and "last good checkpoint (step 4) is kept" in str(e.value)
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [0, 2, 4] and not crashkit_temps(out)
    r = resume_run(out)
    r.train()
    assert_same_params_as(ref_out, r)


def assert_same_params_as(ref_out: Path, run) -> None:
    ref = load_file(ref_out / "model.safetensors")
    assert same(ref, {k: v.detach() for k, v in run.params.items()})


@contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_really_full_disk_stops_cleanly_and_resume_finishes_after_space_is_freed(tmp_path):
    """A real file system that fills up mid-run (a small tmpfs; skipped where mounting is not allowed)."""
    recipe = dict(RECIPE, objective=dict(RECIPE["objective"], model={"kind": "mlp", "hidden": [256, 256]}),
                  train=dict(RECIPE["train"], steps=16))
    path = write_recipe(tmp_path, recipe)
    assert dpreg("run", path, "--out", tmp_path / "ref", "-q").returncode == 0
    with small_tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "out"
        res = dpreg("run", path, "--out", out, "-q")
        FAULTS["injected"] += 1
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "No space left on device" in res.stderr and "is kept" in res.stderr
        kept = ckpt.list_checkpoints(out / "checkpoints")
        assert kept and all(ckpt.read(p) for _, p in kept) and not crashkit_temps(out)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # space freed
        assert dpreg("resume", out, "-q").returncode == 0
        assert_same_run(tmp_path / "ref", out)


def test_stale_temporary_files_and_lock_files_do_not_block_a_run(reference, tmp_path):
    """What a killed run leaves (a lock file naming a live but unrelated process, temporary files)
    neither blocks a new run in the folder nor survives it."""
    recipe, ref_out = reference
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))
    (out / ".probe.tmp-99999").write_text("")
    (out / ".recipe.json.tmp-99999").write_text("{")
    assert dpreg("run", recipe, "--out", out, "-q").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "ledger.jsonl", "metrics.jsonl", "model.safetensors",
                                                     "recipe.json", "summary.json"]
    assert_same_run(ref_out, out)


def test_overwrite_never_deletes_a_run_that_took_the_folder_while_this_one_prepared(tmp_path, monkeypatch, capsys):
    """`--overwrite` checks the lock before preparing (which can take minutes); a run that took the
    folder in the meantime must still be refused, not deleted and then written over."""
    import fcntl
    import sys

    from dpregistry import cli
    from dpregistry.run import Run

    recipe = write_recipe(tmp_path, RECIPE)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # an earlier run's
    held = {}
    prepare = Run.prepare

    def prepare_while_another_run_starts(run):
        prepared = prepare(run)
        fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)  # what run_lock does in the other process
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": 4242, "host": os.uname().nodename}).encode())
        (out / "other-run").write_text("its checkpoints")
        held["fd"] = fd
        return prepared

    monkeypatch.setattr(Run, "prepare", prepare_while_another_run_starts)
    monkeypatch.setattr(sys, "argv", ["dpreg", "run", str(recipe), "--out", str(out), "-q", "--overwrite"])
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        if "fd" in held:
            os.close(held["fd"])
    FAULTS["injected"] += 1
    assert e.value.code == 2 and "another run (pid 4242" in capsys.readouterr().err
    assert (out / "other-run").read_text() == "its checkpoints" and not (out / "recipe.json").exists()


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(reference, tmp_path):
    recipe, ref_out = reference
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)
    for _, p in ckpt.list_checkpoints(out / "checkpoints"):  # as if killed inside the step-0 write
        p.rename(p.with_name(f".{p.name}.tmp-12345"))
    del run
    warnings = []
    r = resume_run(out, warn=warnings.append)
    assert r.step == 0 and "stopped before its first step" in warnings[0]
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [0] and not crashkit_temps(out)
    r.train()
    assert_same_params_as(ref_out, r)


def test_a_run_whose_checkpoints_are_all_lost_after_steps_is_not_restarted(tmp_path):
    """Starting over would forget the charges of the steps taken: refused."""
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)
    run.train()
    for _, p in ckpt.list_checkpoints(out / "checkpoints"):
        p.write_bytes(p.read_bytes()[:200])  # every checkpoint torn
    with pytest.raises(UserError, match="forget what they spent"):
        resume_run(out, warn=lambda m: None)


def test_a_flipped_bit_in_the_ledger_is_detected(tmp_path):
    """The checksum covers the metadata: an edited ledger (fewer charges) is refused on resume."""
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)
    run.train()
    newest = ckpt.list_checkpoints(out / "checkpoints")[-1][1]
    data = newest.read_bytes()
    assert b'\\"count\\": 10' in data  # JSON inside the safetensors header's JSON
    newest.write_bytes(data.replace(b'\\"count\\": 10', b'\\"count\\":  9', 1))  # same length, valid
    with pytest.raises(ckpt.CorruptCheckpoint, match="checksum"):
        ckpt.read(newest)
    warnings = []
    _, meta, path = ckpt.latest_valid(out / "checkpoints", warn=warnings.append)
    assert path != newest and "checksum mismatch" in warnings[0]
    FAULTS["injected"] += 1


def test_zz_fault_count():
    print(f"\nfaults injected: {FAULTS['injected']}")
