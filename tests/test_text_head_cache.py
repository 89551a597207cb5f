"""A frozen encoder is run once over the training set: when only the head of
``hf_text_classification`` trains, its inputs are encoded once, in fixed chunks, and every step
reads them (DPZero's head-only recipe went from two encoder passes per step to none)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

import dpregistry
from conftest import SST2_SUBSET, make_run, rewind, write_recipe
from dpregistry.persample import GradSampler

RECIPE = {"seed": 0, "algorithm": "dpzero",
          "objective": {"name": "hf_text_classification", "trainable": {"include": ["^head\\."]}},
          "model": {"path": "minilm", "max_length": 32, "pooling": "mean", "head_init": "label_descriptions",
                    "label_descriptions": ["The worst film of the year.", "The best film of the year."]},
          "data": {"path": str(SST2_SUBSET), "labels": ["0", "1"], "k_per_class": 40, "max_test": 20},
          "sampler": {"name": "poisson", "batch_size": 16},
          "estimator": {"name": "zo_two_point", "lambda": 1.0e-3, "direction": "gaussian"},
          "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0},
          "update": {"name": "directional_sgd", "lr": 0.1}, "accountant": "rdp",
          "privacy": {"epsilon": 50.0, "delta": 1e-5, "noise": "reproducible"},
          "train": {"steps": 6, "progress": False, "checkpoint_every": 3}}


def encoder_batches(monkeypatch) -> list[int]:
    """The batch size of every call of the (BERT) encoder from now on: the run's setup included (its
    label-description head encodes the descriptions, and its probe forward may fill the cache)."""
    from transformers.models.bert.modeling_bert import BertModel

    seen, real = [], BertModel.forward

    def forward(self, *args, **kw):
        seen.append(len(kw["input_ids"] if "input_ids" in kw else args[0]))
        return real(self, *args, **kw)

    monkeypatch.setattr(BertModel, "forward", forward)
    return seen


def test_the_encoder_runs_once_per_training_example_and_the_losses_are_the_encoders(tmp_path, monkeypatch):
    seen = encoder_batches(monkeypatch)
    run = make_run(RECIPE, tmp_path)
    run.train()
    obj, idx = run.objective, torch.tensor([3, 77, 3, 0])
    # the two label descriptions, the training set once (80 < 128: one chunk), then the held-out
    # evaluation(s): 6 steps of 2 evaluations of about 16 examples would have been 12 batches
    assert seen[:2] == [2, obj.n_train] == [2, 80] and seen[2:] == [len(obj.test_tok)] * (len(seen) - 2)
    assert len(seen) <= 3
    with torch.no_grad():
        cached = obj.batch_losses(idx)
        logits = obj.model.head(F.normalize(obj.model.pool(*obj._pad(obj.train_tok.take(idx.tolist()))), dim=-1))
    torch.testing.assert_close(cached, F.cross_entropy(logits, obj.y_train[idx], reduction="none"),
                               rtol=1e-5, atol=1e-6)  # another padding length: float32 rounding apart


@pytest.mark.parametrize("objective", [{"trainable": {"include": ["^head\\.", "LayerNorm"]}}, {"cache_features": False}],
                         ids=["encoder-trains", "switched-off"])
def test_an_encoder_that_trains_or_a_cache_switched_off_is_not_cached(objective, tmp_path, monkeypatch):
    run = make_run({**RECIPE, "objective": {**RECIPE["objective"], **objective}}, tmp_path)
    seen = encoder_batches(monkeypatch)
    run.train()
    assert not run.objective._cache_features and sum(seen) > run.objective.n_train


def test_per_example_norms_on_cached_features_equal_one_backward_per_example(tmp_path):
    """DP-Adam's hooks see the head's input from the cache: its per-example norms are those of one
    backward per example through the encoder."""
    run = make_run({**RECIPE, "algorithm": "dp_adam", "estimator": {"name": "per_example_grad", "backend": "hooks"},
                    "privatizer": {"name": "gaussian", "clip": 1.0, "noise_multiplier": 1.0},
                    "update": {"name": "adam", "lr": 1e-2}}, tmp_path)
    run.train()
    obj, params, idx = run.objective, run.params, torch.arange(6)
    assert obj._cache_features and set(params) == {"head.weight", "head.bias"}
    ref = []
    for i in idx.tolist():
        logits = obj._logits(*obj._pad(obj.train_tok.take([i])))  # through the encoder, no cache
        grads = torch.autograd.grad(F.cross_entropy(logits, obj.y_train[[i]]), list(params.values()))
        ref.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    gs = GradSampler(obj.module(), params)
    with torch.enable_grad(), gs.capture(len(idx)):
        losses = obj.batch_losses(idx)
    torch.testing.assert_close(gs.contribution(losses).norms().double(), torch.stack(ref), rtol=2e-4, atol=1e-6)


def test_a_resumed_head_only_run_is_bit_identical(tmp_path):
    recipe = write_recipe(tmp_path, RECIPE)
    straight = dpregistry.train(recipe, verbose=False, out=tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    rewind(tmp_path / "b", 3)
    resumed = dpregistry.resume(tmp_path / "b", verbose=False)
    assert resumed.ledger == straight.ledger
    assert all(torch.equal(straight.run.params[k], resumed.run.params[k]) for k in straight.run.params)
