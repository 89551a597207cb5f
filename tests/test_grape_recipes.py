"""The DP-GRAPE recipes: the paper settings resolve, and run here on models built from the shipped
configurations (the paper-size ones shrunk, since their weights are not available offline)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import RECIPES, make_run
from dpregistry.recipe import load

from dpreg_grape.objectives import config_dict


def resolved(name, sets=()):
    return load(RECIPES / name, list(sets)).data


@pytest.mark.parametrize("name,rank,F,lr,T,B,eps,delta,micro", [
    ("roberta-large_sst2_dpgrape.yaml", 16, 100, 1e-4, 1000, 64, 6.0, 1e-5, 32),
    ("roberta-large_sst2_dpgrape_eps2.yaml", 16, 100, 1e-4, 1000, 64, 2.0, 1e-5, 32),
    ("vit-base_cifar10_dpgrape.yaml", 64, 100, 1e-3, 3000, 1000, 8.0, 1.9999e-5, 250),
    ("opt6.7b_dpgrape.yaml", 64, 100, 1e-4, 2000, 8, 6.0, 1e-5, 2),
])
def test_paper_recipes_resolve_with_the_paper_settings(name, rank, F, lr, T, B, eps, delta, micro):
    d = resolved(name)
    assert d["algorithm"]["name"] == "dp_grape"
    assert d["estimator"]["name"] == "projected_per_example_grad"
    assert (d["estimator"]["rank"], d["estimator"]["refresh_every"]) == (rank, F)
    assert d["update"]["name"] == "projected_adam" and d["update"]["lr"] == lr
    assert d["train"]["steps"] == T and d["sampler"]["batch_size"] == B
    assert d["train"]["micro_batch_size"] == micro < B  # the logical batch by gradient accumulation
    assert (d["privacy"]["epsilon"], d["privacy"]["delta"]) == (eps, delta)


def test_minilm_recipes_share_data_steps_batch_and_budget():
    a, b = resolved("minilm_sst2_dp_adam.yaml"), resolved("minilm_sst2_dpgrape.yaml")
    for key in ("sampler", "privatizer", "accountant", "privacy", "train", "seed"):
        assert a[key] == b[key], key
    # the same model, data and head; DP-GRAPE trains DP-Adam's set plus weights it can project
    strip = lambda o: {k: v for k, v in o.items() if k != "trainable"}  # noqa: E731
    assert strip(a["objective"]) == strip(b["objective"])
    assert set(a["objective"]["trainable"]["include"]) < set(b["objective"]["trainable"]["include"])
    assert a["update"]["lr"] == b["update"]["lr"]
    assert (a["update"]["name"], b["update"]["name"]) == ("adam", "projected_adam")


def tiny_hf_folder(tmp_path, config, **dims):
    """A model folder from a shipped configuration with smaller dimensions, and MiniLM's tokenizer
    (the paper models' tokenizers are not available offline; token ids fit every vocabulary)."""
    from dpregistry.hf import resolve_model_dir

    folder = tmp_path / config
    folder.mkdir()
    tok = resolve_model_dir("minilm")
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{tok}/{f}", folder / f)
    (folder / "config.json").write_text(json.dumps({**config_dict(config), **dims}))
    return folder


def small_batches(run, batch_size):
    """Set the run's sampler to a small batch, after calibration at the recipe's batch (the same
    stage, which the run watches for the secrecy of its batches)."""
    run.sampler.cfg = type(run.sampler).Params(batch_size=batch_size)
    run.sampler.setup(run.ctx)


def run_one_step(run):
    before = {k: v.detach().clone() for k, v in run.params.items()}
    run.begin_step()
    run.algorithm.step(run)
    run.step += 1
    moved = {k for k in before if not torch.equal(before[k], run.params[k])}
    return moved


@pytest.mark.parametrize("name,config,dims,sigma_add_remove", [
    ("roberta-large_sst2_dpgrape.yaml", "roberta-large",
     dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64), 1.7969),
    ("opt6.7b_dpgrape.yaml", "opt-6.7b",
     dict(hidden_size=96, word_embed_proj_dim=96, num_hidden_layers=2, num_attention_heads=2, ffn_dim=192), 0.6900),
])
def test_text_recipes_run_on_their_architecture(tmp_path, sst2_dir, name, config, dims, sigma_add_remove):
    """The recipe runs end to end on its architecture (shrunk) and calibrates σ at its real (n, B, T, δ):
    spec §7.14's Opacus value under add/remove, and exactly the same Gaussian (σ/Δ) under replace-one."""
    folder = tiny_hf_folder(tmp_path, config, **dims)
    sets = [f"model.path={folder}", "model.init=random", f"data.path={sst2_dir}", "train.device=cpu"]
    run = make_run(RECIPES / name, tmp_path, sets=sets)
    assert run.n_train == {"roberta-large": 1024, "opt-6.7b": 1000}[config]
    layers = set(run.estimator.shapes)
    assert layers and all("embed" not in n and "head" not in n for n in layers)
    assert any("q_proj" in n or "query" in n for n in layers) and any("fc1" in n or "intermediate" in n for n in layers)
    z_replace = run.privatizer.noise_multiplier
    z_add = make_run(RECIPES / name, tmp_path, sets=sets + ["privacy.relation=add_remove"]).privatizer.noise_multiplier
    assert abs(z_add / sigma_add_remove - 1) < 0.01
    assert abs(z_replace / (2 * z_add) - 1) < 1e-3  # replace-one: sensitivity 2C, the same σ/Δ
    small_batches(run, 4)  # one small step
    moved = run_one_step(run)
    assert layers <= moved


def write_cifar10_binary(folder, n_train, n_test, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir()
    per = -(-n_train // 5)
    for i in range(1, 6):
        n = max(0, min(per, n_train - (i - 1) * per))
        rec = np.concatenate([rng.integers(0, 10, (n, 1)), rng.integers(0, 256, (n, 3072))], 1).astype(np.uint8)
        rec.tofile(folder / f"data_batch_{i}.bin")
    rec = np.concatenate([rng.integers(0, 10, (n_test, 1)), rng.integers(0, 256, (n_test, 3072))], 1).astype(np.uint8)
    rec.tofile(folder / "test_batch.bin")


def test_vit_recipe_runs_on_the_shipped_vit_base(tmp_path):
    """ViT-B/4 from the shipped configuration (no weights: pre-training), CIFAR-10 binary data."""
    data = tmp_path / "cifar"
    write_cifar10_binary(data, 1100, 20)
    run = make_run(RECIPES / "vit-base_cifar10_dpgrape.yaml", tmp_path, sets=[f"objective.data.path={data}"])
    assert run.n_train == 1100
    assert sum(p.numel() for p in run.params.values()) == 85_152_010
    assert len(run.estimator.shapes) == 72  # q, k, v, o, fc1, fc2 in each of 12 blocks
    small_batches(run, 3)
    moved = run_one_step(run)
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings"} <= moved  # the vmap fallback
    assert set(run.estimator.shapes) <= moved
    assert 0.0 <= run.objective.evaluate()["accuracy"] <= 1.0


def test_minilm_dpgrape_recipe_runs(tmp_path, sst2_dir):
    run = make_run(RECIPES / "minilm_sst2_dpgrape.yaml", tmp_path, sets=[f"data.path={sst2_dir}"])
    assert len(run.estimator.shapes) == 6  # the attention-output weight of each of the 6 blocks
    small_batches(run, 4)
    assert set(run.estimator.shapes) <= run_one_step(run)
