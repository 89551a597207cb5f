"""LoRA adapters in the text classifier's encoder (``model.lora``): they and the head train, the base
weights stay as loaded, the adapted model starts where the plain one does, and per-example clipping
sees the adapters' gradients exactly."""

from __future__ import annotations

import torch

from conftest import SST2_SUBSET, make_run
from dpregistry.persample import GradSampler

RECIPE = {"seed": 0, "algorithm": "dp_adam",
          "objective": {"name": "hf_text_classification"},
          "model": {"path": "minilm", "max_length": 32, "pooling": "mean", "head_init": "label_descriptions",
                    "label_descriptions": ["The worst film of the year.", "The best film of the year."]},
          "data": {"path": str(SST2_SUBSET), "labels": ["0", "1"], "k_per_class": 8, "max_test": 40},
          "sampler": {"name": "poisson", "batch_size": 8}, "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
          "update": {"lr": 1e-2}, "accountant": "rdp", "privacy": {"epsilon": 50.0, "delta": 1e-5, "noise": "reproducible"},
          "train": {"steps": 2, "progress": False}}
LORA = {"r": 4, "alpha": 8.0}


def with_lora(**extra):
    return {**RECIPE, "model": {**RECIPE["model"], "lora": {**LORA, **extra}}}


def test_lora_trains_the_adapters_and_the_head_and_starts_where_the_plain_model_does(tmp_path):
    plain = make_run(RECIPE, tmp_path)
    run = make_run(with_lora(), tmp_path)
    names = list(run.params)
    assert names and all("lora_" in n or n.startswith("head.") for n in names) and "head.weight" in names
    assert any(".query." in n for n in names) and any(".value." in n for n in names)  # peft's BERT default
    # B = 0 at the start: the adapted model computes what the plain one does (the zero-shot head)
    assert run.objective.evaluate() == plain.objective.evaluate()
    base = {n: p.detach().clone() for n, p in run.objective.model.named_parameters() if n not in run.params}
    before = {n: p.detach().clone() for n, p in run.params.items()}
    run.train()
    assert any(not torch.equal(before[n], p) for n, p in run.params.items() if "lora_B" in n)
    for n, p in run.objective.model.named_parameters():
        if n in base:
            assert torch.equal(base[n], p), n  # the base weights are bit-for-bit as loaded


def test_per_example_gradients_through_the_adapters_equal_one_backward_per_example(tmp_path):
    run = make_run(with_lora(), tmp_path)
    run.train()  # B ≠ 0 now, so every adapter has a gradient
    obj, params = run.objective, run.params
    idx = torch.arange(5)
    ref = []
    for i in idx.tolist():
        grads = torch.autograd.grad(obj.batch_losses(torch.tensor([i]))[0], list(params.values()))
        ref.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    gs = GradSampler(obj.module(), params)
    with torch.enable_grad(), gs.capture(len(idx)):
        losses = obj.batch_losses(idx)
    norms = gs.contribution(losses).norms()
    # the batch pads to its longest sentence, one example alone does not: float32 rounding apart, equal
    torch.testing.assert_close(norms.double(), torch.stack(ref), rtol=2e-4, atol=1e-6)
