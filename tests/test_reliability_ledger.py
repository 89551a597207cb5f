"""A ledger that cannot shrink (issue 14, item 1): forged checkpoints, deleted checkpoints, runs
killed before they started, and the non-finite limit on resume."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_run, write_recipe
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.errors import UserError
from dpregistry.ledger_file import GENESIS, LedgerFile, _digest
from test_core_cli import dpreg

RECIPE = {
    "seed": 3,
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 1.5},
    "accountant": "rdp",
    "privacy": {"epsilon": 50.0, "delta": 1e-3, "noise": "reproducible"},
    "train": {"steps": 12, "log_every": 2, "checkpoint_every": 4, "keep_checkpoints": 10, "progress": False},
}


def finished(tmp_path, recipe=RECIPE, name="run"):
    out = tmp_path / name
    make_run(recipe, tmp_path, out=out).train()
    return out


def forge(path, edit):
    """What anyone who can write the folder can do: edit a checkpoint's ledger (both copies: the
    metadata's and the accountant's state) and recompute the plain SHA-256 it carries."""
    tensors, meta = ckpt.read(path)
    edit(meta)
    meta["state"]["accountant"]["ledger"] = meta["ledger"]
    meta.pop("checksum")
    ckpt.write_atomic(path, tensors, meta)


def newest(out):
    return ckpt.list_checkpoints(out / "checkpoints")[-1][1]


def test_every_checkpoint_is_recorded_in_a_chained_ledger_file(tmp_path):
    out = finished(tmp_path)
    lines = LedgerFile(out).lines()
    assert [r["step"] for r in lines] == [0, 4, 8, 12]
    for step, path in ckpt.list_checkpoints(out / "checkpoints"):
        assert ckpt.read(path)[1]["ledger"] == LedgerFile(out).at(step)
    assert lines[-1]["entries"][0]["count"] == 12


def test_the_ledger_file_grows_with_the_ledger_not_its_square(tmp_path):
    """Each line held the whole ledger: adaptive noisy GD charges two new events a step and
    checkpoints at every logged row, so a run of T steps wrote about T²/10 entries (a 10⁴-step run
    past the 1 GiB a resume reads). A line now holds what changed since the line before, and
    reading the file gives back each checkpoint's whole ledger."""
    from conftest import REPO

    recipe = (REPO / "recipes" / "kl_adaptive_gd_diabetes.yaml").read_text()
    out = tmp_path / "run"
    run = make_run(recipe, tmp_path, sets=["privacy.rho=1000", "train.log_every=1"], out=out)
    run.train()
    raw = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    final = run.accountant.ledger.to_json()
    assert len(raw) > 20 and len(final) > 40
    size, once = (out / "ledger.jsonl").stat().st_size, len(json.dumps(final))
    assert size < 2 * once + 400 * len(raw), (size, once, len(raw))  # each entry written once (or grown)
    for step, path in ckpt.list_checkpoints(out / "checkpoints"):
        assert ckpt.read(path)[1]["ledger"] == LedgerFile(out).at(step)
    assert LedgerFile(out).last["entries"] == final


def test_a_ledger_file_of_whole_ledgers_is_read_and_continued(tmp_path):
    """Run folders of earlier versions hold the whole ledger on each line; a resume reads them and
    appends lines of what changed after them, in one chain."""
    from conftest import rewind

    out = finished(tmp_path)
    rewind(out, 8)
    prev, text = GENESIS, ""
    for r in LedgerFile(out).lines():
        h = _digest(prev, r["step"], r["entries"])
        text += json.dumps({"step": r["step"], "entries": r["entries"], "prev": prev, "hash": h}) + "\n"
        prev = h
    (out / "ledger.jsonl").write_text(text)
    resumed = resume_run(out, warn=lambda m: None)
    resumed.train()
    raw = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert [("entries" in r, "tail" in r) for r in raw] == [(True, False)] * 3 + [(False, True)]
    assert [r["step"] for r in LedgerFile(out).lines()] == [0, 4, 8, 12]
    assert LedgerFile(out).last["entries"] == resumed.accountant.ledger.to_json()
    assert LedgerFile(out).last["entries"][0]["count"] == 12


def test_a_forged_checkpoint_that_lowers_the_count_is_refused(tmp_path):
    """The audit lowered the ledger's count in a step-60 checkpoint to 30 and resumed to 90 steps:
    ε 2.999 printed against a true 3.777. The ledger file disagrees with the forgery."""
    out = finished(tmp_path)
    forge(ckpt.checkpoint_path(out / "checkpoints", 8), lambda m: m["ledger"][0].update(count=4))
    newest(out).unlink()  # the forged step-8 checkpoint is now the newest
    with pytest.raises(UserError, match="ledger.jsonl recorded at step 8"):
        resume_run(out)


def test_a_forged_checkpoint_and_ledger_file_are_caught_by_the_metrics(tmp_path):
    out = finished(tmp_path)
    forge(newest(out), lambda m: m["ledger"][0].update(count=6))
    # the forger rewrites the whole chained file consistently with the forged checkpoint (no line
    # may lower a count of the line before: those are refused as they are read)
    prev, text = GENESIS, ""
    for r in LedgerFile(out).lines():
        entries = [dict(e, count=min(e["count"], 6)) for e in r["entries"]]
        h = _digest(prev, r["step"], entries)
        text += json.dumps({"step": r["step"], "entries": entries, "prev": prev, "hash": h}) + "\n"
        prev = h
    (out / "ledger.jsonl").write_text(text)
    with pytest.raises(UserError, match="metrics.jsonl logged ε"):
        resume_run(out)


def _nested(event: dict, depth: int) -> dict:
    for _ in range(depth):
        event = {"type": "composed", "events": [event]}
    return event


@pytest.mark.parametrize("added, entry", [  # the last entry replaced, or a new one added after it
    (False, lambda e: dict(e, count=1)),
    (False, lambda e: dict(e, count=-20)),
    (False, lambda e: dict(e, count=10 ** 400)),
    (True, lambda e: 7),
    (True, lambda e: dict(e, event={"type": "gaussian", "std": 1.0})),
    (True, lambda e: dict(e, event=_nested(e["event"], 100))),
    (True, lambda e: dict(e, event={"type": "self_composed", "event": e["event"], "count": 10 ** 400})),
], ids=["a count lowered", "a negative count", "a count past the floats", "an entry that is no entry",
        "an event missing a field", "an event nested 100 deep", "an event's integer past the floats"])
def test_a_chained_line_that_does_not_continue_the_ledger_is_refused(tmp_path, added, entry):
    """Review 21: a line appended with a correct chain but a lower or negative count made
    `dpreg privacy report` print ε 4.944 instead of 11.08, and malformed entries crashed it with a
    traceback; review 23: so did integers past the floats and events nested 900 deep. Each line
    must keep the line before's entries and only grow them, with plain numbers and events."""
    from dpregistry.ledger_file import _line_hash

    out = finished(tmp_path)
    last = json.loads((out / "ledger.jsonl").read_text().splitlines()[-1])
    entries = LedgerFile(out).last["entries"]
    rec = {"step": 13, "keep": len(entries) if added else 0, "tail": [entry(e) for e in entries], "prev": last["hash"]}
    rec["hash"] = _line_hash(rec)
    with open(out / "ledger.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    with pytest.raises(UserError, match="line 5 does not continue the ledger of the line before it"):
        LedgerFile(out).lines()
    res = dpreg("privacy", "report", out)
    assert res.returncode == 2 and "line 5 does not continue" in res.stderr and "Traceback" not in res.stderr


def test_an_event_past_the_floats_is_a_one_line_refusal_of_the_reports(tmp_path):
    """A well-formed entry whose event no accountant can compute (an exponential mechanism of
    ε = 1e308, review 23) crashed `dpreg privacy report` and `dpreg report` with an OverflowError."""
    from dpregistry.ledger_file import _line_hash

    out = finished(tmp_path)
    last = json.loads((out / "ledger.jsonl").read_text().splitlines()[-1])
    event = {"type": "exponential", "epsilon": 1e308, "bounded_range": True}
    rec = {"step": 13, "keep": 1, "prev": last["hash"],
           "tail": [{"event": event, "count": 1, "partition": None, "first_step": 12, "last_step": 12}]}
    rec["hash"] = _line_hash(rec)
    with open(out / "ledger.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    for command in (["privacy", "report"], ["report"]):
        res = dpreg(*command, out)
        assert res.returncode == 2 and "cannot compute (a number past the floats)" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_a_long_ledger_file_is_read_in_memory_of_its_size(tmp_path):
    """Review 21: lines that keep the line before's entries stood each for the whole ledger, so a
    0.86 MB file of 4,000 lines keeping 40,000 entries took 1.26 GB to read. The lines now share
    one list of entries."""
    import tracemalloc

    from dpregistry.ledger_file import _line_hash

    entry = {"event": {"type": "gaussian", "std": 1.0, "sensitivity": 1.0}, "count": 1, "partition": None}
    first = {"step": 1, "keep": 0, "tail": [dict(entry, first_step=i, last_step=i) for i in range(20_000)],
             "prev": GENESIS}
    first["hash"] = _line_hash(first)
    lines, prev = [first], first["hash"]
    for step in range(2, 2_002):
        rec = {"step": step, "keep": 20_000, "tail": [], "prev": prev}
        rec["hash"] = prev = _line_hash(rec)
        lines.append(rec)
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    tracemalloc.start()
    read = LedgerFile(tmp_path).lines()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(read) == 2_001 and len(read[-1]["entries"]) == 20_000 and read[1000]["entries"][-1]["last_step"] == 19_999
    assert peak < 100 * 2**20, peak  # 2,001 whole ledgers of 20,000 entries would be 320 MB of references alone


def test_a_checkpoint_that_charges_steps_it_has_not_taken_is_refused(tmp_path):
    out = finished(tmp_path)
    forge(newest(out), lambda m: m.update(step=4))
    with pytest.raises(UserError):
        resume_run(out)


def test_an_edited_line_of_the_ledger_file_breaks_the_chain(tmp_path):
    out = finished(tmp_path)
    text = (out / "ledger.jsonl").read_text().splitlines()
    rec = json.loads(text[1])
    rec["tail"][0]["count"] = 1
    text[1] = json.dumps(rec)
    (out / "ledger.jsonl").write_text("\n".join(text) + "\n")
    res = dpreg("resume", out)
    assert res.returncode == 2 and "line 2 does not chain" in res.stderr and "Traceback" not in res.stderr


def test_a_finished_run_without_checkpoints_and_metrics_is_refused_not_restarted(tmp_path):
    out = finished(tmp_path)
    for _, p in ckpt.list_checkpoints(out / "checkpoints"):
        p.unlink()
    (out / "metrics.jsonl").unlink()
    model = (out / "model.safetensors").read_bytes()
    res = dpreg("resume", out)
    assert res.returncode == 2, res.stdout
    assert "summary.json" in res.stderr and "ledger.jsonl" in res.stderr and "forget what they spent" in res.stderr
    assert "stopped before its first step" not in res.stderr + res.stdout
    assert (out / "model.safetensors").read_bytes() == model  # nothing released again
    # each trace alone suffices
    for name in ("summary.json", "model.safetensors"):
        (out / name).unlink()
    with pytest.raises(UserError, match="ledger.jsonl"):
        resume_run(out)


@pytest.mark.parametrize("temp", [".probe.tmp-1234", ".recipe.json.tmp-1234"])
def test_a_run_killed_before_it_wrote_its_recipe_is_told_to_start_again(tmp_path, temp):
    out = tmp_path / "run"
    out.mkdir()
    (out / temp).write_text("{")
    (out / ".lock").write_text("")
    res = dpreg("resume", out)
    assert res.returncode == 2 and "stopped before it started" in res.stderr and "--overwrite" in res.stderr
    recipe = write_recipe(tmp_path, RECIPE)
    assert dpreg("run", recipe, "--out", out, "-q").returncode == 0  # leftovers alone never block a run


def test_a_kill_between_the_checkpoint_and_its_ledger_line_resumes(tmp_path):
    """The ledger line is appended after the checkpoint's rename: a kill in between leaves the newest
    checkpoint one line ahead of the file, which extends it; a torn last line is ignored."""
    out = finished(tmp_path)
    text = (out / "ledger.jsonl").read_text().splitlines(keepends=True)
    (out / "ledger.jsonl").write_text("".join(text[:-1]) + text[-1][:40])  # torn while appending step 12
    run = resume_run(out)
    assert run.step == 12
    run.train()
    assert [r["step"] for r in LedgerFile(out).lines()] == [0, 4, 8, 12]


def test_replayable_modes_go_back_to_an_older_checkpoint_secure_refuses(tmp_path):
    straight = finished(tmp_path, name="straight")
    final = ckpt.read(newest(straight))[0]
    for mode in ("reproducible", "secure"):
        out = finished(tmp_path, dict(RECIPE, privacy=dict(RECIPE["privacy"], noise=mode)), name=mode)
        newest(out).unlink()  # the step-12 checkpoint is lost; step 8 remains
        if mode == "secure":
            res = dpreg("resume", out)
            assert res.returncode == 2 and "cannot be replayed" in res.stderr and "8" in res.stderr
            continue
        run = resume_run(out)
        assert run.step == 8
        run.train()
        again = ckpt.read(newest(out))[0]
        assert all(torch.equal(final[k], again[k]) for k in final)  # the replay is the same release
        assert [r["step"] for r in LedgerFile(out).lines()] == [0, 4, 8, 12]


def test_after_the_nonfinite_limit_resume_refuses_until_the_limit_is_raised(tmp_path, monkeypatch):
    from dpreg_baseline.objectives import TabularObjective

    real = TabularObjective.batch_losses
    monkeypatch.setattr(TabularObjective, "batch_losses", lambda self, idx: real(self, idx) * float("nan"))
    recipe = write_recipe(tmp_path, dict(RECIPE, train=dict(RECIPE["train"], max_nonfinite_steps=1)))
    out = tmp_path / "out"
    assert dpreg("run", recipe, "--out", out, "-q").returncode == 1
    charged = LedgerFile(out).last["entries"][0]["count"]
    for _ in range(2):  # each resume used to take one more charged step and stop again
        res = dpreg("resume", out, "-q")
        assert res.returncode == 2 and "non-finite limit" in res.stderr and "--max-nonfinite-steps" in res.stderr
    assert LedgerFile(out).last["entries"][0]["count"] == charged
    monkeypatch.setattr(TabularObjective, "batch_losses", real)
    res = dpreg("resume", out, "--max-nonfinite-steps", "5", "-q")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["step"] == 12
    assert json.loads((out / "recipe.json").read_text())["recipe"]["train"]["max_nonfinite_steps"] == 5


def test_a_step_stopped_by_the_budget_after_a_charge_keeps_the_charge(tmp_path, monkeypatch):
    """Adaptive noisy GD releases and charges a norm query, then finds the step itself unaffordable
    and stops: that query decided the stop, so the step counts, and the final checkpoint and
    ledger.jsonl hold its charge (the final checkpoint was skipped as already written: the charge
    was lost from both; before that, writing it crashed). The finished run then resumes."""
    from conftest import RECIPES

    monkeypatch.setenv("DPREG_NOISE_KEY", "3f1c9a7be2d54c6a8b0e1f2a3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d")  # one path
    out = tmp_path / "r"
    run = make_run(RECIPES / "kl_adaptive_gd_diabetes.yaml", tmp_path, out=out,
                   sets=["train.checkpoint_every=1", "train.keep_checkpoints=3", "train.progress=false", "privacy.noise=keyed",
                         "train.log_every=1000"])
    summary = run.train()
    assert summary["stopped"].startswith(f"privacy budget exhausted at step {run.step - 1}")  # the charged stop
    ledger = json.loads(json.dumps(run.accountant.ledger.to_json()))
    assert ledger[-1]["last_step"] == run.step - 1
    _, meta = ckpt.read(ckpt.list_checkpoints(out / "checkpoints")[-1][1])
    assert meta["step"] == run.step and meta["ledger"] == ledger == LedgerFile(out).last["entries"]
    assert resume_run(out).accountant.ledger.to_json() == ledger


@pytest.mark.parametrize("noise", ["secure", "keyed"])
def test_a_cut_ledger_tail_with_the_newest_checkpoint_is_caught_by_what_was_released(noise, tmp_path, monkeypatch):
    """A chain cannot tell its last lines were removed: with the newest checkpoint and its ledger
    line deleted, a secure run resumed from step 8, released steps 9-12 a second time with other
    noise and charged them once, and the privacy report gave the step-8 ε (a review). The model,
    the summary and held-out evaluations each follow the checkpoint of their step, so one of them
    later than the last charge shows the cut: resume and the reports refuse. A keyed run resumed
    too (review 19): its replay of steps 9-12 had no recorded digest left to be checked against,
    and on other arithmetic released step 12 twice under the same noise."""
    from dpregistry.report import privacy_report

    monkeypatch.setenv("DPREG_NOISE_KEY", "3f1c9a7be2d54c6a8b0e1f2a3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d")
    recipe = dict(RECIPE, privacy=dict(RECIPE["privacy"], noise=noise), train=dict(RECIPE["train"], eval_every=6))
    out = finished(tmp_path, recipe)
    newest(out).unlink()
    lines = (out / "ledger.jsonl").read_text().splitlines(keepends=True)
    (out / "ledger.jsonl").write_text("".join(lines[:-1]))  # a valid chain, one line shorter
    evidence = {"summary.json": "summary.json records step 12", "model.safetensors":
                "model.safetensors was written at step 12", "metrics.jsonl": "metrics.jsonl holds a held-out "
                "evaluation at step 12"}
    for name, said in evidence.items():
        with pytest.raises(UserError, match=f"{said}, after the newest charge .* \\(step 8\\)"):
            resume_run(out)
        with pytest.raises(UserError, match=f"{said}, after the last charge .* \\(step 8\\)"):
            privacy_report(out, plot=False)
        if name == "metrics.jsonl":  # the training rows after step 8 stay: a crash leaves those
            rows = [json.loads(x) for x in (out / name).read_text().splitlines()]
            (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows if not any(k.startswith("eval/")
                                                                                     and r["step"] > 8 for k in r)))
        else:
            (out / name).unlink()
    assert resume_run(out).step == 8  # what a crash after step 8 leaves: resumed


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    return finished(tmp_path_factory.mktemp("done"))


def within(seconds: int, *command):
    """dpreg ``command`` in this process, failing the test if it takes longer (a blocked open)."""
    import signal

    def late(signum, frame):
        raise TimeoutError(f"dpreg {' '.join(map(str, command))} took over {seconds} s")

    before = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        return dpreg(*command)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "recipe.json", ".lock", "ledger.jsonl",
                                  "checkpoints/step-00000099.safetensors", "model.safetensors"])
def test_a_fifo_in_the_run_folder_is_refused_or_skipped_never_waited_on(done, tmp_path, name):
    """Opening a FIFO for reading blocks until someone writes it: resume, report, privacy report
    and export hung on one in place of these files (a review)."""
    import os
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done, out)
    (out / name).unlink(missing_ok=True)
    os.mkfifo(out / name)
    for command in (["resume", out], ["privacy", "report", out], ["report", out],
                    ["export", out, "--to", tmp_path / "hf"]):
        res = within(20, *command)  # an exception other than an exit fails the test here
        assert "Traceback" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "recipe.json", "ledger.jsonl"])
def test_deeply_nested_json_in_the_run_folder_gives_one_line_not_a_traceback(done, tmp_path, name):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done, out)
    (out / name).write_text("[" * 100_000 + "\n")
    for command in (["resume"], ["privacy", "report"], ["report"]):
        res = dpreg(*command, out)
        assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr, res.stderr[-2000:]
