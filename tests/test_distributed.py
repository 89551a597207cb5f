"""Data parallelism on torch.distributed (gloo, 2 processes on localhost, started by the tests).

Zeroth-order runs are bit-identical to the single-process run; first-order runs equal it up to
floating-point reduction order; ε is identical; checkpoints cross between 1 and 2 processes; a
killed rank stops the run with the last checkpoint intact, and `dpreg resume` finishes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import rewind
from dpregistry import checkpoint as ckpt

#: processes started, killed and resumed: with the long tests (-m slow), which .ci/run runs
pytestmark = pytest.mark.slow

ZO = """\
algorithm: standard
seed: 1
objective: {name: tabular, model: {kind: mlp, hidden: [16]}, data: {dataset: wine}}
sampler: {name: poisson, batch_size: 32}
estimator: {name: zo_two_point, lambda: 1.0e-3}
privatizer: {name: gaussian, clip: 2.0, noise_multiplier: auto}
update: {name: directional_sgd, lr: 0.01}
accountant: rdp
privacy: {epsilon: 8.0, delta: 1.0e-3, noise: reproducible}
train: {steps: 20, log_every: 5, micro_batch_size: 8, sync_check_every: 1, checkpoint_every: 5, keep_checkpoints: 10}
"""
FO = ZO.replace("algorithm: standard", "algorithm: dp_adam").replace(
    "estimator: {name: zo_two_point, lambda: 1.0e-3}\n", "").replace(
    "update: {name: directional_sgd, lr: 0.01}", "update: {lr: 0.01}")

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def dpreg(*args, nproc=1, popen=False):
    cmd = [sys.executable, "-m", "dpregistry", *map(str, args)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "dpregistry", *map(str, args)]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV)


def model(out: Path):
    return load_file(out / "model.safetensors")


def summary(out: Path):
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight 1- and 2-process runs of the ZO and first-order recipes, the four at once (each
    process has one thread; their imports would leave a core idle one after the other)."""
    root = tmp_path_factory.mktemp("dist")
    out, procs = {}, []
    for name, text in (("zo", ZO), ("fo", FO)):
        recipe = root / f"{name}.yaml"
        recipe.write_text(text)
        out[name] = recipe
        for n in (1, 2):
            out[name, n] = root / f"{name}{n}"
            procs.append(dpreg("run", recipe, "--out", out[name, n], "-q", nproc=n, popen=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    return root, out


def test_zeroth_order_two_processes_equal_one_bit_for_bit(runs):
    _, out = runs
    a, b = model(out["zo", 1]), model(out["zo", 2])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary(out["zo", 1])["epsilon"] == summary(out["zo", 2])["epsilon"]
    rows = [json.loads(x) for x in (out["zo", 2] / "metrics.jsonl").read_text().splitlines()]
    # only per-example scalars crossed the network: B floats, whatever the model size
    per_step = [r["comm_bytes_per_step"] for r in rows]
    assert max(per_step) < 64 * 4 * 2  # at most a padded batch of fp32 values and losses


def test_first_order_two_processes_equal_one_to_reduction_tolerance(runs):
    _, out = runs
    a, b = model(out["fo", 1]), model(out["fo", 2])
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=1e-5) for k in a)
    assert summary(out["fo", 1])["epsilon"] == summary(out["fo", 2])["epsilon"]
    ledger1 = ckpt.latest_valid(out["fo", 1] / "checkpoints")[1]["ledger"]
    ledger2 = ckpt.latest_valid(out["fo", 2] / "checkpoints")[1]["ledger"]
    assert ledger1 == ledger2


@pytest.mark.parametrize("written_by,resumed_by", [(2, 1), (1, 2)])
def test_checkpoints_cross_between_process_counts(runs, written_by, resumed_by, tmp_path):
    import shutil

    _, out = runs
    run_dir = tmp_path / "run"
    shutil.copytree(out["zo", written_by], run_dir)
    rewind(run_dir, 10)
    res = dpreg("resume", run_dir, "-q", nproc=resumed_by)
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = model(out["zo", 1]), model(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary(run_dir)["epsilon"] == summary(out["zo", 1])["epsilon"]


def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(p.name))
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def test_a_killed_rank_stops_the_run_and_resume_finishes_it(runs, tmp_path, request):
    root, out = runs
    long = root / "long.yaml"
    long.write_text(ZO.replace("steps: 20", "steps: 3000").replace("checkpoint_every: 5", "checkpoint_every: 100")
                    .replace("sync_check_every: 1", "sync_check_every: 50"))
    run_dir, straight = tmp_path / "run", tmp_path / "straight"
    straight_run = dpreg("run", long, "--out", straight, "-q", popen=True)  # one thread, alongside
    request.addfinalizer(straight_run.kill)  # a no-op once it has finished
    proc = dpreg("run", long, "--out", run_dir, "-q", nproc=2, popen=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(ckpt.list_checkpoints(run_dir / "checkpoints")) < 2:
        time.sleep(0.2)
    assert ckpt.list_checkpoints(run_dir / "checkpoints"), "the run never wrote a checkpoint"
    victims = [c for c in _children(proc.pid) if _rank_of(c) == 1]
    assert victims, "rank 1 not found"
    os.kill(victims[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not (run_dir / "summary.json").exists() or summary(run_dir)["step"] < 3000
    tensors, meta, _ = ckpt.latest_valid(run_dir / "checkpoints")  # intact and verified
    assert 0 < meta["step"] < 3000
    res = dpreg("resume", run_dir, "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    _, err = straight_run.communicate(timeout=600)
    assert straight_run.returncode == 0, err[-3000:]
    a, b = model(straight), model(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert summary(run_dir)["epsilon"] == summary(straight)["epsilon"]


NONSMOOTH = """\
seed: 3
algorithm: {name: ztc_o2nc_tree, episode_len: 8}
objective: {name: l1_distance, dim: 5, n: 400, noise_std: 0.3, init: 3.0}
estimator: {name: zo_sphere, smooth_radius: 0.1, lipschitz: 1.0, dirs_per_sample: dim}
update: {name: o2nc, output: random_window}
accountant: zcdp
privacy: {rho: 0.5, delta: 1.0e-6, noise: reproducible}
train: {steps: 40, log_every: 10, micro_batch_size: 2, sync_check_every: 1}
"""


def test_nonsmooth_oracles_on_two_processes_equal_one(tmp_path):
    """Every rank draws the directions of every slot, so a slot's estimate does not depend on which
    rank evaluates it: two processes match one up to the order of the all-reduced sum."""
    recipe = tmp_path / "ztc.yaml"
    recipe.write_text(NONSMOOTH)
    for n in (1, 2):
        res = dpreg("run", recipe, "--out", tmp_path / f"o{n}", "-q", nproc=n)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = model(tmp_path / "o1"), model(tmp_path / "o2")
    assert all(torch.allclose(a[k], b[k], atol=1e-9, rtol=1e-9) for k in a)
    assert summary(tmp_path / "o1")["rho"] == summary(tmp_path / "o2")["rho"]


def test_a_rank_without_examples_gathers_in_the_dtype_of_the_others(tmp_path):
    """A batch no larger than one micro-batch leaves rank 1 without a chunk: its empty values must
    have the other rank's dtype (fp64 here), or the all-gather of the per-example scalars breaks."""
    recipe = tmp_path / "q.yaml"
    recipe.write_text(ZO.replace("{name: tabular, model: {kind: mlp, hidden: [16]}, data: {dataset: wine}}",
                                 "{name: quadratic, dim: 8, n: 500, n_test: 50}")
                      .replace("micro_batch_size: 8", "micro_batch_size: 64").replace("steps: 20", "steps: 4"))
    for n in (1, 2):
        res = dpreg("run", recipe, "--out", tmp_path / f"q{n}", "-q", nproc=n)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = model(tmp_path / "q1"), model(tmp_path / "q2")
    assert a["x"].dtype == torch.float64 and all(torch.equal(a[k], b[k]) for k in a)


SIGNAL_RANK0_IN_CHECKPOINT = """\
import os, signal, sys
from dpregistry import cli, folder

save = folder.RunFolder.save_checkpoint

def save_then_signal(self, run):
    path = save(self, run)
    if run.comm.rank == 0 and run.step == 5 and not run.stop_reason:
        os.kill(os.getpid(), signal.SIGTERM)  # reaches rank 0 alone, after the step's stop vote
    return path

folder.RunFolder.save_checkpoint = save_then_signal
sys.argv = ["dpreg", *sys.argv[1:]]
cli.main()
"""


def test_a_signal_to_one_rank_during_a_checkpoint_stops_every_rank_after_the_same_step(runs, tmp_path):
    """Ranks decide together whether to take another step: one that stopped alone would leave the
    others inside a collective (a hang or a crash instead of a clean stop)."""
    root, out = runs
    script = tmp_path / "signal_rank0.py"
    script.write_text(SIGNAL_RANK0_IN_CHECKPOINT)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "run", str(out["zo"]), "--out", str(run_dir), "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too
        proc.communicate()
        raise
    assert "lost contact" not in stderr, stderr[-3000:]
    assert summary(run_dir)["step"] == 5 and "SIGTERM" in summary(run_dir)["stopped"]
    assert ckpt.latest_valid(run_dir / "checkpoints")[1]["step"] == 5
    assert dpreg("resume", run_dir, "-q", nproc=2).returncode == 0
    a, b = model(out["zo", 1]), model(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_only_rank_0_rewrites_the_metrics_on_resume(tmp_path):
    """A resume truncates metrics.jsonl to the checkpoint's step: on rank 0 only. Another rank's
    rewrite raced rank 0's removal of stale temporary files (its temporary file vanished and it
    stopped with a storage error) and, on several nodes, wrote into rank 0's folder."""
    from conftest import make_run
    from dpregistry.distributed import LocalComm
    from dpregistry.folder import resume_run

    out = tmp_path / "out"
    make_run(FO.replace("steps: 20", "steps: 10"), tmp_path, out=out).train()
    for s, p in ckpt.list_checkpoints(out / "checkpoints"):
        if s > 5:
            p.unlink()
    before = (out / "metrics.jsonl").stat().st_ino

    class Rank1(LocalComm):
        rank = 1

    r = resume_run(out, comm=Rank1(), warn=lambda m: None)
    assert r.step == 5 and (out / "metrics.jsonl").stat().st_ino == before


def test_a_refusal_on_rank_0_reaches_every_rank(runs, tmp_path):
    """Rank 0 alone takes the folder's lock: when it is refused (another process holds the run),
    every rank must stop with that refusal, not wait in a collective for a rank that left."""
    from dpregistry.folder import run_lock

    _, out = runs
    run_dir = tmp_path / "zo2"
    shutil.copytree(out["zo", 2], run_dir)
    with run_lock(run_dir):
        res = dpreg("resume", run_dir, "-q", nproc=2)
    assert res.returncode != 0
    assert res.stderr.count("is using this folder") == 2, res.stderr[-3000:]  # one line from each rank
    assert "lost contact" not in res.stderr


RANKS_DIFFER = """\
import atexit, json, os, sys, torch, dpregistry
from dpregistry.errors import UserError
rank = int(os.environ["RANK"])
# runs after dpregistry's own exit handler (last in, first out): the group it joined is gone by then
atexit.register(lambda: open(f"{sys.argv[3]}/left{rank}", "w").write(str(torch.distributed.is_initialized())))
said = []
# a shard per rank, the usual data-parallel habit (same size, other rows)
g = torch.Generator().manual_seed(rank)
data = torch.utils.data.TensorDataset(torch.randn(200, 3, generator=g), torch.randint(0, 2, (200,), generator=g))
recipe = {"algorithm": "dp_sgd", "sampler": {"batch_size": 10}, "update": {"lr": 0.01},
          "privatizer": {"clip": 1.0, "noise_multiplier": 1.0}, "privacy": {"delta": 1e-4}, "train": {"steps": 3}}
try:
    dpregistry.train(recipe, model=torch.nn.Linear(3, 2), loss=torch.nn.CrossEntropyLoss(reduction="none"),
                     train_data=data, verbose=False)
except UserError as e:
    said.append(str(e))
# a stale copy of the run folder on rank 1
try:
    dpregistry.resume(sys.argv[1] if rank == 0 else sys.argv[2], verbose=False)
except UserError as e:
    said.append(str(e))
open(f"{sys.argv[3]}/rank{rank}.json", "w").write(json.dumps(said))
"""


def test_ranks_with_other_data_or_another_checkpoint_are_refused(runs, tmp_path):
    """Ranks compared only the recipe and the noise key: with a shard of its own on each rank (same
    size), each summed other records at a rate the ledger never saw (a review: a record used at
    0.039 a step under a q of 0.01); ranks that read different checkpoints (a stale folder on one
    node) summed the batches of different steps. Both are refused before any step, on every rank."""
    _, out = runs
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    shutil.copytree(out["zo", 2], fresh)
    shutil.copytree(out["zo", 2], stale)
    rewind(fresh, 15)
    rewind(stale, 10)
    script = tmp_path / "differ.py"
    script.write_text(RANKS_DIFFER)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script), str(fresh), str(stale), str(tmp_path)], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # the caller left nothing to tear down: a live gloo group at interpreter shutdown aborted a rank
    assert [(tmp_path / f"left{r}").read_text() for r in (0, 1)] == ["False", "False"]
    for data, resumed in said:
        assert data.startswith("<recipe>: data: the ranks hold different training data (") and "200 records" in data
    assert sorted(x[1].split(".safetensors: ", 1)[1] for x in said) == [
        "the ranks resumed from different checkpoints (rank 0: step 15; another rank differs); every rank must "
        "read the same run folder",
        "the ranks resumed from different checkpoints (rank 1: step 10; rank 0: step 15); every rank must read the "
        "same run folder"]
    assert json.loads((fresh / "ledger.jsonl").read_text().splitlines()[-1])["step"] <= 15  # no step taken
