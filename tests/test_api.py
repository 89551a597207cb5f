"""The Python API (issue 16): dpregistry.train / resume, your own model and data, and the README's
Python snippets run verbatim."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dpregistry
from conftest import REPO, rewind
from dpregistry import UserError


def readme_snippets() -> list[str]:
    """The README's Python blocks, but the plugin guide's (which define a package, tested in
    tests/test_contract_plugins.py)."""
    text = (REPO / "README.md").read_text()
    guide = text.index("## Writing a plugin")
    end = text.index("\n## ", guide + 3)
    text = text[:guide] + text[end:]
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("i", range(len(readme_snippets())))
def test_each_readme_python_snippet_runs(i, capsys):
    code = readme_snippets()[i]
    namespace: dict = {}
    exec(compile(code, f"README.md snippet {i}", "exec"), namespace)
    if "result" in namespace:  # the usage example: a private run of one's own model that learns
        result = namespace["result"]
        assert result.epsilon <= 3.0 and result.guarantee
        assert result.metrics["accuracy"] > 0.5  # chance is 0.1
        assert "held-out accuracy" in capsys.readouterr().out


DIGITS = None


def digits():
    global DIGITS
    if DIGITS is None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        DIGITS = (torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
    return DIGITS


def own(n_train=600):
    x, y = digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    train = list(zip(x[:n_train], y[:n_train]))
    test = torch.utils.data.TensorDataset(x[1400:], y[1400:])
    return model, train, test


RECIPE = {"algorithm": "dp_sgd", "sampler": {"batch_size": 64}, "update": {"lr": 0.5},
          "privacy": {"epsilon": 4.0, "delta": 1e-5, "noise": "reproducible"}, "train": {"steps": 20, "checkpoint_every": 10}}


def per_example(out, t):
    return F.cross_entropy(out, t, reduction="none")


def test_own_model_loss_and_data_train_privately_into_a_run_folder(tmp_path):
    model, train, test = own()
    a = dpregistry.train(RECIPE, model=model, loss=per_example, train_data=train, eval_data=test, verbose=False,
                         out=tmp_path / "a")
    assert a.model is model and a.epsilon <= 4.0 and set(a.metrics) == {"loss", "accuracy"}
    assert a.ledger and a.ledger[0]["count"] == 20 and a.run_dir == tmp_path / "a"
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["epsilon"] == a.epsilon and summary["metrics"] == a.metrics
    # a run folder resumes only the recipe it was started with
    model_b, train_b, test_b = own()
    recipe = dict(RECIPE, train=dict(RECIPE["train"], steps=10))
    dpregistry.train(recipe, model=model_b, loss=per_example, train_data=train_b, verbose=False, out=tmp_path / "b")
    stored = json.loads((tmp_path / "b" / "recipe.json").read_text())
    stored["recipe"]["train"]["steps"] = 20  # the user extends the run they planned
    from dpregistry.recipe import recipe_hash

    stored["recipe_hash"] = recipe_hash(stored["recipe"])
    (tmp_path / "b" / "recipe.json").write_text(json.dumps(stored))
    with pytest.raises(UserError, match="different recipe"):  # the checkpoint knows its recipe
        dpregistry.resume(tmp_path / "b", model=model_b, loss=per_example, train_data=train_b, verbose=False)


def test_a_resumed_own_run_continues_the_ledger(tmp_path):
    model, train, test = own()
    straight = dpregistry.train(RECIPE, model=model, loss=per_example, train_data=train, verbose=False)
    model_b, train_b, _ = own()
    b = dpregistry.train(RECIPE, model=model_b, loss=per_example, train_data=train_b, verbose=False,
                         out=tmp_path / "b")
    rewind(tmp_path / "b", 10)  # as a crash after step 10 would leave the folder
    # other data is refused (a review resumed a shuffle run on 80 records after 40: records used
    # 4 times were charged as 3 uses): more rows, fewer, or as many with one changed row near the end
    model_c, train_c, _ = own()
    x, y = digits()
    changed = train_c[:-1] + [(torch.zeros_like(train_c[-1][0]), train_c[-1][1])]
    for other in (train_c + list(zip(x[1400:1410], y[1400:1410])), train_c[:-10], changed):
        with pytest.raises(UserError, match=r"step-00000010\.safetensors: data: the training data is not the data of the checkpoint's run "
                                            r"\(now \d+ records, digest \w+; then 600 records"):
            dpregistry.resume(tmp_path / "b", model=model_c, loss=per_example, train_data=other, verbose=False)
    c = dpregistry.resume(tmp_path / "b", model=model_c, loss=per_example, train_data=train_c, verbose=False)
    assert c.summary["step"] == 20 and c.ledger == straight.ledger == b.ledger
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model_c.parameters()))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_python_caller_after_the_run_is_saved(sig, tmp_path):
    """A loop over configurations stops on Ctrl-C as it would without dpregistry (Stopped is a
    KeyboardInterrupt; SIGTERM exits as a terminated process, 143), after the run saved what it
    spent: the exception carries the Result, and resume finishes the run as one straight run would."""
    model, train, _ = own()
    straight = dpregistry.train(RECIPE, model=model, loss=per_example, train_data=train, verbose=False)
    calls = {"n": 0}

    def loss(out, t):
        calls["n"] += len(t) > 8  # a training batch (the setup's probes take at most 8 examples)
        if calls["n"] == 3 and len(t) > 8:  # mid-run: the step finishes, then the run stops
            os.kill(os.getpid(), sig)
        return per_example(out, t)

    model_b, train_b, _ = own()
    expected = dpregistry.Stopped if sig == signal.SIGINT else dpregistry.Terminated
    with pytest.raises(expected) as stop:
        dpregistry.train(RECIPE, model=model_b, loss=loss, train_data=train_b, verbose=False, out=tmp_path / "b")
    assert isinstance(stop.value, KeyboardInterrupt if sig == signal.SIGINT else SystemExit)
    if sig == signal.SIGTERM:
        assert stop.value.code == 143
    result = stop.value.result
    assert 0 < result.summary["step"] < 20 and signal.Signals(sig).name in result.stopped
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["step"] == result.summary["step"]
    c = dpregistry.resume(tmp_path / "b", model=model_b, loss=per_example, train_data=train_b, verbose=False)
    assert c.summary["step"] == 20 and c.ledger == straight.ledger
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model_b.parameters()))


def test_the_progress_bar_ends_on_what_a_stopped_run_spent(tmp_path):
    """Review 15: after Ctrl-C the bar showed the ε of the last logged row, not of the last step."""
    from rich.console import Console

    calls = {"n": 0}

    def loss(out, t):
        calls["n"] += len(t) > 8
        if calls["n"] == 3 and len(t) > 8:
            os.kill(os.getpid(), signal.SIGINT)
        return per_example(out, t)

    model, train, _ = own()
    console = Console(record=True, width=200)
    with pytest.raises(dpregistry.Stopped) as stop:
        dpregistry.train(dict(RECIPE, train={"steps": 20, "log_every": 10}), model=model, loss=loss,
                         train_data=train, out=tmp_path / "b", console=console)
    eps = stop.value.result.epsilon
    assert stop.value.result.summary["step"] < 10 and eps > 0  # stopped before the first logged row
    bar = console.export_text()
    assert f" {stop.value.result.summary['step']}/20 " in bar and f" ε {eps:.3g} (no guarantee" in bar


def test_a_loss_of_model_and_batch_serves_any_example_shape():
    x, y = digits()
    rows = [{"pixels": x[i], "label": y[i]} for i in range(300)]
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)

    def loss(model, batch):
        return F.cross_entropy(model(batch["pixels"]), batch["label"], reduction="none")

    held_out = [{"pixels": x[i], "label": y[i]} for i in range(300, 400)]
    r = dpregistry.train(RECIPE, model=model, loss=loss, train_data=rows, eval_data=held_out, verbose=False)
    assert r.summary["step"] == 20 and set(r.metrics) == {"loss"}


def test_a_hugging_face_dataset_is_read_by_index():
    datasets = pytest.importorskip("datasets")
    x, y = digits()
    ds = datasets.Dataset.from_dict({"pixels": x[:300].tolist(), "label": y[:300].tolist()}).with_format("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)

    def loss(model, batch):
        return F.cross_entropy(model(batch["pixels"].float()), batch["label"], reduction="none")

    r = dpregistry.train(RECIPE, model=model, loss=loss, train_data=ds, verbose=False)
    assert r.summary["step"] == 20 and r.epsilon <= 4.0


@pytest.mark.parametrize("bad, says", [
    ({"loss": lambda out, t: F.cross_entropy(out, t)}, "one loss per example"),
    ({"train_data": []}, "train_data is empty"),
    ({"train_data": 42}, "train_data must be indexable"),
    ({"loss": None}, "missing: loss"),
])
def test_bad_own_objects_are_one_line_errors(bad, says):
    model, train, _ = own()
    objects = {"model": model, "loss": per_example, "train_data": train, **bad}
    with pytest.raises(UserError, match=says) as e:
        dpregistry.train(RECIPE, verbose=False, **objects)
    assert "\n" not in str(e.value)


def test_held_out_data_that_holds_training_examples_is_refused():
    """The held-out metrics are covered by the guarantee only when they are computed on other data:
    with eval_data=train_data a threshold on the held-out loss told a canary's presence 16 times
    in 16 at ε = 1 (a review). The same object, TensorDatasets of the same tensors and
    random_split Subsets whose indices meet (or one and the whole), overlapping views of one tensor's
    rows and lists holding the same examples are refused before any step; disjoint ones train, also
    when they share a constant column."""
    x, y = digits()
    model, _, _ = own()
    full = torch.utils.data.TensorDataset(x[:800], y[:800])
    first, rest = torch.utils.data.random_split(full, [600, 200], generator=torch.Generator().manual_seed(0))
    overlapping = torch.utils.data.Subset(full, [int(first.indices[0]), *map(int, rest.indices)])
    rows = list(zip(x[:800], y[:800]))
    for train, held_out in [(full, full), (full, torch.utils.data.TensorDataset(*full.tensors)),
                            (first, overlapping), (first, full), (rows, rows[:100]),
                            (torch.utils.data.TensorDataset(x[:300], y[:300]),
                             torch.utils.data.TensorDataset(x[200:400], y[200:400]))]:
        with pytest.raises(UserError, match="eval_data holds training examples") as e:
            dpregistry.train(RECIPE, model=model, loss=per_example, train_data=train, eval_data=held_out,
                             verbose=False)
        assert e.value.key.endswith("eval_data")
    r = dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=per_example, train_data=first,
                         eval_data=rest, verbose=False)
    assert r.summary["step"] == 2 and "accuracy" in r.metrics
    ones = torch.ones(800, 1)

    def with_ones(model, batch):
        return per_example(model(batch[0] * batch[1]), batch[2])

    r = dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=with_ones,
                         train_data=torch.utils.data.TensorDataset(x[:400], ones[:400], y[:400]),
                         eval_data=torch.utils.data.TensorDataset(x[400:800], ones[:400], y[400:800]), verbose=False)
    assert r.summary["step"] == 2


def test_a_model_with_a_weight_used_outside_its_layer_is_refused_before_step_1():
    class Reuse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.lin(x) + F.linear(x, self.lin.weight)

    _, train, _ = own()
    with pytest.raises(UserError, match=r"lin\.weight"):
        dpregistry.train(RECIPE, model=Reuse(), loss=per_example, train_data=train, verbose=False)


def test_a_bad_recipe_raises_the_cli_message(tmp_path):
    from test_core_cli import dpreg

    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: dp_adam\nobjective: {name: tabular, data: {dataset: iris}}\n"
                    "privacy: {epsilon: 3.0, delta: 1.0e-5}\ntrain: {steps: -1}\n")
    with pytest.raises(UserError) as e:
        dpregistry.train(path, verbose=False)
    assert str(e.value).startswith(f"{path}:4: train.steps:")
    cli = dpreg("run", path, "--out", tmp_path / "out")
    assert cli.returncode == 2 and cli.stderr.strip() == f"error: {e.value}"


@pytest.mark.slow
def test_model_loading_draws_no_third_party_progress_bar(capfd):
    """transformers' own per-load bar and head warnings are silenced: the run's progress speaks."""
    from transformers.utils import logging as tlog

    tlog.enable_progress_bar()  # as in a fresh process (another test may have turned them off)
    sst2 = Path(__file__).resolve().parent / "data" / "sst2"
    dpregistry.train("minilm_sst2_dp_adam", set=[f"data.path={sst2}", "train.steps=1", "data.k_per_class=8",
                                                  "sampler.batch_size=4", "privacy.noise=reproducible"], verbose=False)
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "it/s" not in out + err
    assert tlog.is_progress_bar_enabled()  # restored for the user's own loads afterwards


@pytest.mark.parametrize("hub_bars_off", [True, False])
def test_silencing_the_hf_libraries_restores_each_ones_own_settings(hub_bars_off, monkeypatch):
    """transformers' bar switch also flips huggingface_hub's: a user who turned the hub's bars off
    (or left them on) and set datasets' verbosity finds both as they were."""
    import importlib

    import huggingface_hub.utils as hub

    # as when HF_HUB_DISABLE_PROGRESS_BARS is unset (read once, when the hub is first imported)
    monkeypatch.setattr(importlib.import_module("huggingface_hub.utils.tqdm"), "HF_HUB_DISABLE_PROGRESS_BARS", None)
    from datasets.utils import logging as dlog
    from transformers.utils import logging as tlog

    from dpregistry.hf import quiet

    tlog.enable_progress_bar()
    (hub.disable_progress_bars if hub_bars_off else hub.enable_progress_bars)()
    dlog.set_verbosity(dlog.INFO)
    try:
        with quiet():
            assert hub.are_progress_bars_disabled() and not tlog.is_progress_bar_enabled()
            assert dlog.get_verbosity() > dlog.ERROR
        assert hub.are_progress_bars_disabled() == hub_bars_off and tlog.is_progress_bar_enabled()
        assert dlog.get_verbosity() == dlog.INFO
    finally:
        dlog.set_verbosity(dlog.WARNING)
        hub.enable_progress_bars()


def test_resuming_a_finished_run_keeps_its_wall_time(tmp_path):
    """The summary's wall time is the run's: a resume of a finished run took milliseconds and used
    to overwrite it with them."""
    out = tmp_path / "run"
    dpregistry.train("quickstart", out=out, set=["train.steps=5"], verbose=False)
    first = json.loads((out / "summary.json").read_text())["wall_seconds"]
    dpregistry.resume(out, verbose=False)
    again = json.loads((out / "summary.json").read_text())["wall_seconds"]
    assert first <= again <= first + 5.0


def test_overwriting_a_run_that_spent_says_so(tmp_path, monkeypatch):
    """--overwrite deletes the earlier run's ledger: the privacy it spent on the same data is not
    undone, and the replacement says so before it trains (a review)."""
    import dpregistry.api as api

    model, train, _ = own(200)
    recipe = dict(RECIPE, train={"steps": 2, "checkpoint_every": 1})
    dpregistry.train(recipe, model=model, loss=per_example, train_data=train, verbose=False, out=tmp_path / "r")
    said: list[str] = []
    monkeypatch.setattr(api, "_sayer", lambda verbose, console: said.append)  # what a verbose run prints
    dpregistry.train(recipe, model=model, loss=per_example, train_data=train, verbose=False, out=tmp_path / "r",
                     overwrite=True)
    assert "replacing a run that took 2 steps: its ledger goes with it, and privacy spent on the same data adds up " \
           "across runs" in said


def test_the_data_digest_sees_order_and_ignores_random_augmentation(tmp_path):
    """A shuffle run resumed on the same rows in another order used 42 records twice and 42 never
    in one epoch under one charge (a review): a list's or TensorDataset's every record is in the
    digest. A data set whose __getitem__ adds random noise was refused as other data: each record is
    read under fixed seeds. And evaluation runs without autograd (a metric may call .numpy())."""
    from dpregistry.digest import dataset_digest

    x, y = digits()
    rows = list(zip(x[:200], y[:200]))
    moved = rows[:100] + rows[101:150] + [rows[100]] + rows[150:]
    assert dataset_digest(rows) != dataset_digest(moved)
    whole = torch.utils.data.Subset(rows, range(200))
    assert dataset_digest(whole) != dataset_digest(torch.utils.data.Subset(moved, range(200)))
    data = torch.utils.data.TensorDataset(x[:200], y[:200])
    assert dataset_digest(data) != dataset_digest(torch.utils.data.TensorDataset(x[:200].flip(0), y[:200].flip(0)))
    assert dataset_digest(torch.utils.data.Subset(data, range(10, 60))) == dataset_digest(
        torch.utils.data.TensorDataset(x[10:60], y[10:60]))

    class Jitter(torch.utils.data.Dataset):
        def __len__(self):
            return 200

        def __getitem__(self, i):
            return x[i] + 0.01 * torch.randn(64), y[i]

    torch.manual_seed(1)
    first, after = dataset_digest(Jitter()), torch.randn(1)
    torch.manual_seed(1)
    assert torch.equal(torch.randn(1), after)  # the caller's generator is left as it was
    assert dataset_digest(Jitter()) == first
    model, _, test = own()
    result = dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=per_example, train_data=Jitter(),
                              eval_data=test, verbose=False,
                              metrics={"p_numpy": lambda out, t: float(out.softmax(-1)[:, 0].numpy().mean())})
    assert 0 < result.metrics["p_numpy"] < 1


class WritesState(torch.nn.Module):
    """A linear model whose forward also writes a buffer from the batch (kept, not used)."""

    def __init__(self, write):
        super().__init__()
        self.linear, self.write = torch.nn.Linear(64, 10), write
        self.register_buffer("state", torch.zeros(64))

    def forward(self, x):
        self.write(self.state, x)
        return self.linear(x)


@pytest.mark.parametrize("write", [lambda s, x: s.copy_(torch.maximum(s, x.max(0).values)),  # the largest seen
                                   lambda s, x: s.mul_(0.5).add_(0.5 * x.mean(0))],         # a running mean
                         ids=["largest seen", "running mean"])
def test_a_forward_that_writes_the_models_state_is_refused_before_step_1(write):
    """Review 14: a buffer written in forward left with the model, without noise (the released
    "largest value seen" was the private data's column maximum, 6 columns of 6). (A running mean
    that the output also used made the batch-mixing probe see a random forward and skip its
    comparison; the write is what is refused now, whether the output uses it or not.)"""
    _, train, _ = own()
    with pytest.raises(UserError, match="forward writes its buffer"):
        dpregistry.train(RECIPE, model=WritesState(write), loss=per_example, train_data=train, verbose=False)


class WritesThroughData(torch.nn.Module):
    """A frozen parameter written through ``.data`` in forward: its version counter stays."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10)
        self.largest = torch.nn.Parameter(torch.zeros(64), requires_grad=False)

    def forward(self, x):
        self.largest.data.copy_(torch.maximum(self.largest.data, x.max(0).values))
        return self.linear(x)


def test_a_parameter_written_through_data_is_refused_and_a_lazy_module_trains():
    """Review 16: a write through ``.data`` passed the version-counter check (the model kept the
    private column maxima), and a lazy layer's uninitialised parameter crashed the snapshot."""
    _, train, _ = own()
    with pytest.raises(UserError, match="forward writes its parameter largest"):
        dpregistry.train(RECIPE, model=WritesThroughData(), loss=per_example, train_data=train, verbose=False)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(10))
    r = dpregistry.train(dict(RECIPE, train={"steps": 2}), model=lazy, loss=per_example, train_data=train,
                         verbose=False)
    assert r.summary["step"] == 2


class WritesNowAndThen(torch.nn.Module):
    """Writes a record of the batch into its state every 20th call only (a plain counter): past the
    setup's probe forwards."""

    def __init__(self, through_data: bool):
        super().__init__()
        self.linear, self.calls, self.through_data = torch.nn.Linear(64, 10), 0, through_data
        self.register_buffer("kept", torch.zeros(64))
        self.frozen = torch.nn.Parameter(torch.zeros(64), requires_grad=False)

    def forward(self, x):
        self.calls += 1
        if self.calls % 20 == 0:
            (self.frozen.data if self.through_data else self.kept).copy_(x.detach()[0])
        return self.linear(x)


@pytest.mark.parametrize("through_data", [False, True], ids=["buffer", "frozen parameter through .data"])
def test_a_forward_that_writes_its_state_now_and_then_is_refused(through_data):
    """Review 34: the state was compared around one probe forward, so a buffer refreshed from the
    batch every 20th call left the run holding a training record, verbatim, with a guarantee. The
    run now watches the buffers and untrained parameters at every step (by value for buffers, by
    version for parameters) and by value before the model leaves it."""
    _, train, _ = own()
    what = "parameter frozen" if through_data else "buffer kept"
    with pytest.raises(UserError, match=f"forward writes its {what}"):
        dpregistry.train(dict(RECIPE, train={"steps": 25}), model=WritesNowAndThen(through_data), loss=per_example,
                         train_data=train, verbose=False)


def test_a_loss_that_no_parameter_reaches_is_refused():
    """Review 14: a loss of detached outputs trained on noise alone, every clipped fraction 0."""
    model, train, _ = own()
    with pytest.raises(UserError, match="do not depend on any trainable parameter"):
        dpregistry.train(RECIPE, model=model, loss=lambda out, t: per_example(out.detach(), t), train_data=train,
                         verbose=False)


@pytest.mark.parametrize("users, says", [
    ([None] + [1] * 599, "no user in users"), ([1.0] * 600, "not floats"), (torch.zeros(300, 2), "shape (300, 2)"),
    ([True, False] * 300, "bool"), (["a", 1] * 300, "one kind for all"),
    ({i: i // 20 for i in range(600)}, "a sequence of user ids"), ("ab" * 300, "a sequence of user ids"),
    ([np.float32(i // 2) for i in range(600)], "not floats"), ([Decimal(i // 2) for i in range(600)], "not floats"),
    (torch.arange(600).to(torch.bfloat16), "not floats"), ([2 ** 64 + i // 2 for i in range(600)], "at most 64 bits")],
    ids=["None", "floats", "2-D", "bools", "mixed kinds", "a dict", "a text", "NumPy floats", "Decimals", "bfloat16",
         "beyond 64 bits"])
def test_bad_user_ids_are_one_line_errors(users, says):
    """Review 14: text ids, None, object arrays and 2-D ids escaped as torch's errors, or were flattened;
    review 16: a dict gave its keys (one user per example), a text its characters; review 17: NumPy
    floats and Decimals were taken as ids, and a bfloat16 tensor raised a TypeError."""
    model, train, _ = own()
    recipe = dict(RECIPE, privacy={"epsilon": 4.0, "delta": 1e-5, "unit": "user", "max_examples_per_user": 2})
    with pytest.raises(UserError, match=re.escape(says)) as e:
        dpregistry.train(recipe, model=model, loss=per_example, train_data=train, users=users, verbose=False)
    assert "\n" not in str(e.value)


def test_the_functorch_backend_without_functional_losses_is_one_line():
    """Your own model has per-example losses through its module, not as a function of the
    parameters: ``backend: functorch`` raised a bare NotImplementedError mid-step (review 22)."""
    model, train, _ = own()
    recipe = dict(RECIPE, estimator={"backend": "functorch"})
    with pytest.raises(UserError, match="backend 'functorch' needs per-example losses as a function") as e:
        dpregistry.train(recipe, model=model, loss=per_example, train_data=train, verbose=False)
    assert "\n" not in str(e.value) and "hooks" in str(e.value)


def test_text_user_ids_are_numbered_as_a_files_user_column_is():
    from dpregistry.own import _user_ids

    assert _user_ids(["Ann", "ann ", "Ｂob", "bob", "Ann"], 5).tolist() == [0, 0, 1, 1, 0]
    assert _user_ids(torch.tensor([7, 3, 7]), 3).tolist() == [0, 1, 0]


@pytest.mark.parametrize("make, says", [
    (lambda rows: {"train": rows}, "a dict"),
    (lambda rows: type("Stream", (torch.utils.data.IterableDataset,), {
        "__iter__": lambda self: iter(rows), "__len__": lambda self: len(rows)})(), "a stream (IterableDataset)")])
def test_data_that_cannot_be_sampled_by_index_is_refused(make, says):
    model, train, _ = own()
    with pytest.raises(UserError, match=re.escape(says)):
        dpregistry.train(RECIPE, model=model, loss=per_example, train_data=make(train), verbose=False)


def test_held_out_rows_of_the_training_hugging_face_dataset_are_refused():
    """Review 14: ``select``, ``shuffle`` and ``with_format`` make new Datasets over the training
    rows, and each passed as held-out; a ``train_test_split``'s two sides do not meet."""
    datasets = pytest.importorskip("datasets")
    x, y = digits()
    ds = datasets.Dataset.from_dict({"pixels": x[:300].tolist(), "label": y[:300].tolist()}).with_format("torch")

    def loss(model, batch):
        return F.cross_entropy(model(batch["pixels"].float()), batch["label"], reduction="none")

    for held_out in (ds.select(range(250, 300)), ds.shuffle(seed=1), ds.with_format("numpy"),
                     ds.select(range(250, 300)).select_columns(["label", "pixels"])):  # reordered (review 16)
        with pytest.raises(UserError, match="eval_data holds training examples"):
            dpregistry.train(RECIPE, model=torch.nn.Linear(64, 10), loss=loss, train_data=ds.select(range(260)),
                             eval_data=held_out, verbose=False)
    split = ds.train_test_split(test_size=0.2, seed=0)
    r = dpregistry.train(dict(RECIPE, train={"steps": 2}), model=torch.nn.Linear(64, 10), loss=loss,
                         train_data=split["train"], eval_data=split["test"], verbose=False,
                         metrics={"n": lambda model, batch: torch.ones(len(batch["label"]))})
    assert r.summary["step"] == 2 and r.metrics["n"] == 1.0


def test_a_model_trained_again_in_place_is_warned_about(capfd):
    """Review 14: the module trains in place; a sweep passing one model to each run trained each
    on the last one's output while each result stated only its own ε."""
    model, train, _ = own()
    dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=per_example, train_data=train, verbose=False)
    assert "already trained" not in capfd.readouterr().err
    dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=per_example, train_data=train, verbose=False)
    err = capfd.readouterr().err
    assert "already trained by dpregistry.train in this process (ε = " in err and "copy.deepcopy(model)" in err


def test_a_model_that_a_failed_run_trained_is_warned_about_too(capfd):
    """Review 16: a run that failed after some private steps (out of memory on a larger Poisson
    batch, say) had trained the module in place and left it unmarked, so the retry said nothing."""
    model, train, _ = own()
    w0 = model[0].weight.detach().clone()
    calls = {"n": 0, "fail_after": float("inf")}

    def failing_later(out, target):
        calls["n"] += 1
        if calls["n"] > calls["fail_after"]:
            raise MemoryError("simulated: out of memory at a later step")
        return per_example(out, target)

    recipe = dict(RECIPE, train={"steps": 2})
    dpregistry.train(recipe, model=copy.deepcopy(model), loss=failing_later, train_data=train, verbose=False)
    calls.update(n=0, fail_after=calls["n"])  # the calls of preparing and two steps: the third fails
    with pytest.raises(MemoryError):
        dpregistry.train(dict(RECIPE, train={"steps": 4}), model=model, loss=failing_later, train_data=train,
                         verbose=False)
    assert not torch.equal(w0, model[0].weight.detach())  # it took steps before it failed
    capfd.readouterr()
    dpregistry.train(dict(RECIPE, train={"steps": 2}), model=model, loss=per_example, train_data=train, verbose=False)
    assert "already trained by dpregistry.train in this process (ε = " in capfd.readouterr().err


def test_what_train_refuses_is_located_at_train_not_at_a_set():
    """Review 18: a BatchNorm model or held-out rows of the training data were reported as
    "--set: objective…", though no --set was given."""
    model, train, _ = own()
    with pytest.raises(UserError) as e:
        dpregistry.train(RECIPE, model=model, loss=per_example, train_data=train, eval_data=train[:50], verbose=False)
    assert str(e.value).startswith("dpregistry.train: objective.eval_data: eval_data holds training examples")
    batch_norm = torch.nn.Sequential(torch.nn.Linear(64, 10), torch.nn.BatchNorm1d(10))
    with pytest.raises(UserError) as e:
        dpregistry.train(RECIPE, model=batch_norm, loss=per_example, train_data=train, verbose=False)
    assert str(e.value).startswith("dpregistry.train: objective: BatchNorm1d")
