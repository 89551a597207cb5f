"""Crash safety: `dpreg run` killed with SIGKILL at random moments (some deliberately inside a
checkpoint write) and resumed each time ends bit-identical to an uninterrupted run, with the same
ε, ledger and metrics; no kill leaves a checkpoint that cannot be loaded. SIGINT and SIGTERM write
a checkpoint and exit cleanly. Two runs never share an output folder.

The default run makes a few kills per recipe; set DPREG_KILLS (for example 25) for the long
harness. Kill, survival and checkpoint-write counts are printed (pytest -s) and asserted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import crashkit
from dpregistry import checkpoint as ckpt

#: processes started, killed and resumed: with the long tests (-m slow), which .ci/run runs
pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("DPREG_KILLS", "3"))

# First order (DP-Adam, Adam moments in the checkpoint) with a model of ~300k parameters, so a
# checkpoint is a few MB and its write takes long enough to be hit on purpose.
FIRST_ORDER = """\
seed: 5
algorithm: dp_adam
objective: {{name: tabular, model: {{kind: mlp, hidden: [512, 512]}}, data: {{dataset: digits}}}}
sampler: {{name: poisson, batch_size: 32}}
privatizer: {{clip: 1.0, noise_multiplier: 1.1}}
update: {{lr: 0.001}}
accountant: rdp
privacy: {{epsilon: 1000.0, delta: 1.0e-5, noise: reproducible}}
train: {{steps: {steps}, log_every: 3, eval_every: 10, checkpoint_every: 2, keep_checkpoints: 3, progress: false}}
"""
# Zeroth order (parameters displaced in place during a step) on the same model.
ZEROTH_ORDER = """\
seed: 6
algorithm: standard
objective: {{name: tabular, model: {{kind: mlp, hidden: [512, 512]}}, data: {{dataset: digits}}}}
sampler: {{name: poisson, batch_size: 32}}
estimator: {{name: zo_two_point, lambda: 1.0e-3}}
privatizer: {{name: gaussian, clip: 2.0, noise_multiplier: 1.1}}
update: {{name: directional_sgd, lr: 1.0e-3}}
accountant: rdp
privacy: {{epsilon: 1000.0, delta: 1.0e-5, noise: reproducible}}
train: {{steps: {steps}, log_every: 3, eval_every: 10, checkpoint_every: 2, keep_checkpoints: 3, progress: false}}
"""
RECIPES = {"first_order": FIRST_ORDER, "zeroth_order": ZEROTH_ORDER}


def steps_for(kills: int) -> int:
    return max(40, 8 * kills)


def rows(out: Path) -> list[dict]:
    """metrics.jsonl without the wall clock (everything else must repeat exactly)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "wall_seconds"} for x in lines]


def newest_ledger(out: Path):
    _, meta, _ = ckpt.latest_valid(out / "checkpoints", warn=lambda m: None)
    return meta["step"], meta["ledger"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, started exactly like the killed ones."""
    root = tmp_path_factory.mktemp("reference")
    assert crashkit.run_to_end(["--help"], root / "warmup.log") == 0  # start the fork server first
    out = {}
    for name, text in RECIPES.items():
        recipe = root / f"{name}.yaml"
        recipe.write_text(text.format(steps=steps_for(KILLS)))
        t0 = time.time()
        child = crashkit.launch(["run", recipe, "--out", root / name, "-q"], root / f"{name}.log")
        step0 = ckpt.checkpoint_path(root / name / "checkpoints", 0)
        crashkit.wait_for(lambda: step0.exists() or child.poll() is not None, 300, 0.002)
        startup = time.time() - t0  # imports done in the fork server: the recipe, data, model, step 0
        assert child.wait(300) == 0, child.output()[-3000:]
        out[name] = (recipe, root / name, time.time() - t0, startup)
    return out


def assert_same_run(a: Path, b: Path, same_rows: bool = True) -> None:
    ma, mb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma), "parameters differ"
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["epsilon"] == sb["epsilon"] and sa["step"] == sb["step"] and sa["metrics"] == sb["metrics"]
    assert newest_ledger(a) == newest_ledger(b)
    if same_rows:  # every metric row logged exactly once, with the same values
        assert rows(a) == rows(b)


def check_after_kill(out: Path, stats: dict) -> None:
    """What a kill may leave: only whole, verified checkpoints; temporary files; a torn last row."""
    for step, path in ckpt.list_checkpoints(out / "checkpoints"):
        tensors, meta = ckpt.read(path)  # raises if torn or corrupted: atomic writes make it impossible
        assert meta["step"] == step
        assert sum(e["count"] for e in meta["ledger"]) == step  # one (Poisson) charge per step, none lost
        stats["checkpoints_verified"] += 1
    if crashkit.checkpoint_temps(out):
        stats["kills_in_checkpoint_write"] += 1
    m = out / "metrics.jsonl"
    if m.exists() and m.read_bytes() and not m.read_bytes().endswith(b"\n"):
        stats["torn_metric_rows"] += 1


def newest_step(out: Path) -> int:
    cks = ckpt.list_checkpoints(out / "checkpoints")
    return cks[-1][0] if cks else -1


def kill_and_resume(name: str, recipe: Path, ref_seconds: float, startup: float, steps: int, out: Path,
                    kills: int, seed: int) -> dict:
    """Start the run and SIGKILL it ``kills`` times, restarting it each time the way a user would.

    Kills cycle through three kinds of moment: a random time around start-up (loading the recipe,
    data and model, writing recipe.json and the step-0 checkpoint, restoring one), a random point of training (a random step ahead, plus a
    random fraction of a few steps, so it lands anywhere in a step, a log write or a checkpoint),
    and right inside a checkpoint write (the moment its temporary file appears)."""
    rnd = random.Random(seed)
    stats = dict(kills=0, kills_in_checkpoint_write=0, kills_in_startup=0, kills_before_first_checkpoint=0,
                 checkpoints_verified=0, torn_metric_rows=0, launches=0)
    log = out.parent / f"{out.name}.log"
    step_seconds = ref_seconds / steps
    attempts = 0
    while stats["kills"] < kills:
        attempts += 1
        assert attempts < 10 * kills + 10, stats
        argv = ["resume", out, "-q"] if (out / "recipe.json").exists() else ["run", recipe, "--out", out, "-q"]
        child = crashkit.launch(argv, log)
        stats["launches"] += 1
        kind = stats["kills"] % 3
        if kind == 0:
            time.sleep(rnd.uniform(0, startup * 1.5))
        elif kind == 1:
            here = max(newest_step(out), 0)
            ahead = max(1, (steps - here) // (kills - stats["kills"] + 1))
            target = here + rnd.randint(1, ahead)
            crashkit.wait_for(lambda: newest_step(out) >= target or child.poll() is not None, 120, 0.002)
            time.sleep(rnd.uniform(0, 3 * step_seconds))
        else:
            time.sleep(rnd.uniform(0, step_seconds * 4))
            crashkit.wait_for(lambda: crashkit.checkpoint_temps(out) or child.poll() is not None, 120)
        before_first = newest_step(out) < 0
        in_startup = time.time() - child.started < startup  # loading, restoring, before the first step
        if child.kill():
            stats["kills"] += 1
            stats["kills_before_first_checkpoint"] += before_first
            stats["kills_in_startup"] += in_startup
            check_after_kill(out, stats)
        else:
            code = child.poll()
            assert code == 0, child.output()[-3000:]
            if (out / "summary.json").exists():
                break  # finished before the kill landed; the remaining kills would need a longer run
    code = crashkit.run_to_end(["resume", out, "-q"] if (out / "recipe.json").exists()
                               else ["run", recipe, "--out", out, "-q"], log)
    assert code == 0, log.read_text()[-3000:]
    assert not crashkit.checkpoint_temps(out) and not (out / ".lock").exists()
    return stats


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sigkill_at_random_moments_then_resume_is_bit_identical(name, reference, tmp_path):
    recipe, ref_out, ref_seconds, startup = reference[name]
    stats = kill_and_resume(name, recipe, ref_seconds, startup, steps_for(KILLS), tmp_path / "run", KILLS,
                            seed=zlib.crc32(name.encode()))
    print(f"\n{name}: {stats}")
    assert stats["kills"] == KILLS, stats
    assert_same_run(ref_out, tmp_path / "run")


def test_kill_inside_a_checkpoint_write_leaves_the_previous_checkpoint(reference, tmp_path):
    """Aimed kills: the process dies between creating the temporary file and renaming it."""
    recipe, ref_out, ref_seconds, _ = reference["first_order"]
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    hits = 0
    for attempt in range(6):
        argv = ["resume", out, "-q"] if (out / "recipe.json").exists() else ["run", recipe, "--out", out, "-q"]
        child = crashkit.launch(argv, log)
        crashkit.wait_for(lambda: len(ckpt.list_checkpoints(out / "checkpoints")) >= 1 or child.poll() is not None,
                          60, 0.01)
        crashkit.wait_for(lambda: crashkit.checkpoint_temps(out) or child.poll() is not None, 60)
        assert child.kill(), child.output()[-2000:]
        if crashkit.checkpoint_temps(out):
            hits += 1
            stats = dict(checkpoints_verified=0, kills_in_checkpoint_write=0, torn_metric_rows=0)
            check_after_kill(out, stats)
            assert stats["checkpoints_verified"] >= 1
            if hits == 2:
                break
    assert hits >= 1, "no kill landed inside a checkpoint write"
    # resume removes the temporary files of the killed writer and finishes bit-identically
    assert crashkit.run_to_end(["resume", out, "-q"], log) == 0, log.read_text()[-3000:]
    assert not crashkit.checkpoint_temps(out)
    assert_same_run(ref_out, out)
    print(f"\nkills inside a checkpoint write: {hits}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_sigint_and_sigterm_write_a_checkpoint_and_exit_cleanly(sig, reference, tmp_path):
    recipe, ref_out, _, _ = reference["first_order"]
    out, log = tmp_path / "run", tmp_path / "run.log"
    child = crashkit.launch(["run", recipe, "--out", out], log)
    assert crashkit.wait_for(lambda: any(s >= 4 for s, _ in ckpt.list_checkpoints(out / "checkpoints")), 120, 0.005)
    assert child.signal(sig)
    code = child.wait(120)
    assert code == 128 + sig, child.output()[-3000:]  # as a shell reports a signal, after a clean stop
    assert "Traceback" not in child.output()
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped"] == f"stopped by {signal.Signals(sig).name}"
    said = " ".join(child.output().split())
    assert f"{signal.Signals(sig).name}: stopping after the current step" in said  # at once, before the stop
    assert f"resume with: dpreg resume {out}" in said
    tensors, meta = ckpt.read(ckpt.checkpoint_path(out / "checkpoints", s["step"]))  # the final checkpoint
    assert meta["step"] == s["step"] and sum(e["count"] for e in meta["ledger"]) == s["step"]
    assert not (out / ".lock").exists()
    assert crashkit.run_to_end(["resume", out], log) == 0, log.read_text()[-3000:]
    said = " ".join(log.read_text().split())
    assert f"at step {s['step']} of" in said and f"spent so far: ε = {s['epsilon']:.4g}" in said
    assert_same_run(ref_out, out)


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(reference, tmp_path):
    from test_core_cli import dpreg

    recipe, _, _, _ = reference["first_order"]
    out, log = tmp_path / "run", tmp_path / "run.log"
    first = crashkit.launch(["run", recipe, "--out", out, "-q"], log)
    try:
        assert crashkit.wait_for(lambda: (out / "recipe.json").exists(), 120, 0.005), first.output()
        first.signal(signal.SIGSTOP)  # hold it mid-run, lock held
        before = sorted(p.name for p in out.rglob("*"))
        for args in (["run", recipe, "--out", out], ["run", recipe, "--out", out, "--overwrite"], ["resume", out]):
            res = dpreg(*args)
            assert res.returncode == 2, (args, res.stderr)
            assert f"another run (pid {first.pid}" in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert sorted(p.name for p in out.rglob("*")) == before  # the refused runs wrote nothing
    finally:
        first.signal(signal.SIGCONT)
        first.kill()
    # the killed run's lock file is left behind, but the kernel released its lock: resume works
    assert (out / ".lock").exists()
    assert crashkit.run_to_end(["resume", out, "-q"], log) == 0, log.read_text()[-3000:]


def test_a_real_dpreg_process_killed_and_resumed(reference, tmp_path):
    """Once through `python -m dpregistry` itself (no fork server), as a user starts it."""
    recipe, ref_out, _, _ = reference["zeroth_order"]
    out, log = tmp_path / "run", tmp_path / "run.log"
    child = crashkit.launch(["run", recipe, "--out", out, "-q"], log, exec_=True)
    assert crashkit.wait_for(lambda: any(s >= 2 for s, _ in ckpt.list_checkpoints(out / "checkpoints"))
                             or child.poll() is not None, 180, 0.005)
    assert child.kill(), child.output()[-2000:]
    assert crashkit.run_to_end(["resume", out, "-q"], log, exec_=True) == 0, log.read_text()[-3000:]
    assert_same_run(ref_out, out)


# ---------------------------------------------------------------------------------------------
# every shipped recipe that runs in seconds, plugins' recipes included as they land
# ---------------------------------------------------------------------------------------------

SMALL_OBJECTIVES = ("tabular", "quadratic")
#: recipes the plugin issues promise (skipped until their plugin lands)
PROMISED = ["quadratic_dpzero.yaml", "quadratic_dpgd0th.yaml"]


def small_recipes() -> list[str]:
    import yaml

    from conftest import RECIPES as RECIPE_DIR

    names = set(PROMISED)
    for path in RECIPE_DIR.glob("*.yaml"):
        text = yaml.safe_load(path.read_text()) or {}
        obj = text.get("objective")
        name = obj if isinstance(obj, str) else (obj or {}).get("name")
        if name in SMALL_OBJECTIVES:
            names.add(path.name)
    return sorted(names)


@pytest.mark.parametrize("recipe_name", small_recipes())
def test_shipped_recipes_resume_bit_identically_after_a_crash(recipe_name, tmp_path):
    from conftest import RECIPES as RECIPE_DIR
    from conftest import crash_at, make_run
    from dpregistry.folder import resume_run

    path = RECIPE_DIR / recipe_name
    if not path.exists():
        pytest.skip(f"recipes/{recipe_name} does not exist yet (its plugin has not landed)")
    sets = ["privacy.noise=reproducible", "train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=10",
            "train.progress=false",
            "train.log_every=3", "train.eval_every=null"]
    straight = make_run(path, sets=sets, out=tmp_path / "a")
    s_a = straight.train()
    crashing = make_run(path, sets=sets, out=tmp_path / "b")
    crash_at(crashing, crashing.total_steps // 2 + 1)
    resumed = resume_run(tmp_path / "b", warn=lambda m: None)
    s_b = resumed.train()
    assert s_a["step"] == s_b["step"] and s_a["epsilon"] == s_b["epsilon"]
    assert straight.accountant.ledger.to_json() == resumed.accountant.ledger.to_json()
    assert all(torch.equal(v, resumed.params[k]) for k, v in straight.params.items())
    assert rows(tmp_path / "a") == rows(tmp_path / "b")
