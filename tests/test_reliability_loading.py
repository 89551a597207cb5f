"""Loading safety: checkpoints and models load without pickle.

Each malicious file below carries a pickle whose loading would create a marker file; the tests
check that it is refused and that the marker never appears (the payload never ran).
"""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import REPO, make_run
from dpregistry import checkpoint as ckpt
from dpregistry.folder import resume_run
from dpregistry.errors import UserError
from dpregistry.hf import require_safetensors_weights, resolve_model_dir

RECIPE = {
    "seed": 1,
    "algorithm": "dp_sgd",
    "objective": {"name": "tabular", "model": {"kind": "linear"}, "data": {"dataset": "iris"}},
    "sampler": {"name": "poisson", "batch_size": 16},
    "privatizer": {"clip": 1.0, "noise_multiplier": 2.0},
    "privacy": {"epsilon": 50.0, "delta": 1e-3},
    "train": {"steps": 4, "checkpoint_every": 2, "keep_checkpoints": 5, "progress": False},
}


class Payload:
    """Unpickling this calls open(marker, "w"): proof that the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious_files(tmp_path: Path) -> dict[str, bytes]:
    marker = tmp_path / "PWNED"
    zipped = tmp_path / "zipped.pt"
    torch.save({"weight": torch.zeros(2), "x": Payload(marker)}, zipped)
    return {"raw pickle": pickle.dumps({"w": Payload(marker)}, protocol=4),
            "torch.save zip": zipped.read_bytes()}


def test_the_payloads_are_live(tmp_path):
    """Control: unpickling these files does run code (so the refusals below mean something)."""
    files = malicious_files(tmp_path)
    pickle.loads(files["raw pickle"])
    assert (tmp_path / "PWNED").exists()
    (tmp_path / "PWNED").unlink()
    (tmp_path / "m.pt").write_bytes(files["torch.save zip"])
    torch.load(tmp_path / "m.pt", weights_only=False)
    assert (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("kind", ["raw pickle", "torch.save zip"])
def test_a_pickle_disguised_as_a_checkpoint_is_refused_and_never_run(kind, tmp_path):
    out = tmp_path / "out"
    run = make_run(RECIPE, tmp_path, out=out)
    run.train()
    marker = tmp_path / "PWNED"
    evil = ckpt.checkpoint_path(out / "checkpoints", 99)  # the newest name: resume tries it first
    evil.write_bytes(malicious_files(tmp_path)[kind])
    with pytest.raises(ckpt.CorruptCheckpoint):
        ckpt.read(evil)
    with pytest.raises(UserError, match="not a safetensors file"):
        ckpt.require_safetensors(evil)
    warnings = []
    r = resume_run(out, warn=warnings.append)
    assert r.step == 4 and "skipping corrupted checkpoint" in warnings[0] and str(evil) in warnings[0]
    assert not marker.exists()


def test_torch_load_refuses_pickled_code_by_default(tmp_path):
    """Where torch.load is involved (transformers' .bin path), weights_only=True is torch's default."""
    marker = tmp_path / "PWNED"
    path = tmp_path / "m.pt"
    path.write_bytes(malicious_files(tmp_path)["torch.save zip"])
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    assert not marker.exists()


def minilm_dir() -> Path:
    return Path(resolve_model_dir("minilm"))


def test_a_pickle_only_model_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(minilm_dir() / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(malicious_files(tmp_path)["raw pickle"])
    with pytest.raises(UserError, match="only as pickles") as e:
        resolve_model_dir(str(folder))
    assert e.value.key == "model.path" and "pytorch_model.bin" in str(e.value)
    # without weights needed (a random initialisation from the config), the folder is fine
    assert resolve_model_dir(str(folder), need_weights=False) == str(folder)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match="no model weights"):
        require_safetensors_weights(folder)
    assert not (tmp_path / "PWNED").exists()


def test_a_stray_safetensors_file_does_not_admit_pickled_model_weights(tmp_path):
    """transformers loads model.safetensors (or its index) and otherwise falls back to the pickle:
    another *.safetensors in the folder (an adapter, a tokenizer) must not pass the check."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(minilm_dir() / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(malicious_files(tmp_path)["torch.save zip"])
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(UserError, match="only as pickles"):
        resolve_model_dir(str(folder))
    assert not (tmp_path / "PWNED").exists()


def test_a_model_folder_with_both_formats_loads_the_safetensors_and_never_the_pickle(tmp_path, sst2_dir):
    """transformers prefers model.safetensors; the pickle beside it is never opened."""
    from test_core_cli import dpreg

    folder = tmp_path / "model"
    shutil.copytree(minilm_dir(), folder)
    (folder / "pytorch_model.bin").write_bytes(malicious_files(tmp_path)["torch.save zip"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""\
algorithm: dp_adam
objective: hf_text_classification
model: {{path: {folder}, max_length: 16}}
data: {{path: {sst2_dir}, k_per_class: 4, max_test: 8}}
sampler: {{name: poisson, batch_size: 4}}
privatizer: {{clip: 1.0, noise_multiplier: 1.0}}
accountant: rdp
privacy: {{epsilon: 1000.0, delta: 1.0e-5}}
train: {{steps: 1}}
""")
    res = dpreg("validate", recipe)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "PWNED").exists()


UNSAFE = [
    (re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
    (re.compile(r"weights_only\s*=\s*False"), "weights_only=False"),
    (re.compile(r"\b(c?pickle|dill|joblib)\.loads?\("), "unpickling"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True (runs code from model folders)"),
    (re.compile(r"use_safetensors\s*=\s*False"), "use_safetensors=False"),
    (re.compile(r"yaml\.(unsafe_load|full_load)\(|yaml\.load\((?![^)]*Loader\s*=\s*(_Loader|yaml\.SafeLoader))"),
     "a YAML loader that builds arbitrary objects"),
]


def test_no_code_in_the_library_or_its_plugins_unpickles():
    """A scan of dpregistry/ and plugins/ (new plugins included): nothing loads pickles."""
    found = []
    for path in sorted((REPO / "dpregistry").rglob("*.py")) + sorted((REPO / "plugins").rglob("*.py")):
        text = path.read_text()
        for pattern, what in UNSAFE:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not found, "\n".join(found)


def test_pretrained_image_models_load_from_safetensors_only(tmp_path):
    """The DP-GRAPE image objective loads `init: pretrained` weights through the same check as the
    text objectives: a pickle-only folder is refused (never unpickled), model.safetensors loads."""
    from transformers import ViTConfig, ViTForImageClassification

    from test_grape_recipes import write_cifar10_binary

    data = tmp_path / "cifar"
    write_cifar10_binary(data, 40, 8)
    folder = tmp_path / "vit"
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32,
                    patch_size=8, num_labels=10, architectures=["ViTForImageClassification"])
    torch.manual_seed(0)
    ViTForImageClassification(cfg).save_pretrained(folder, safe_serialization=True)
    recipe = {"seed": 0, "algorithm": "dp_adam",
              "objective": {"name": "image_classification", "model": {"config": str(folder), "init": "pretrained"},
                            "data": {"path": str(data)}},
              "sampler": {"name": "poisson", "batch_size": 4}, "privatizer": {"clip": 1.0, "noise_multiplier": 1.0},
              "privacy": {"epsilon": 1000.0, "delta": 1e-3}, "train": {"steps": 1, "progress": False}}
    saved = ViTForImageClassification.from_pretrained(folder).state_dict()
    run = make_run(recipe, tmp_path)
    assert all(torch.equal(run.objective.model.state_dict()[k], v) for k, v in saved.items())

    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(malicious_files(tmp_path)["torch.save zip"])
    with pytest.raises(UserError, match="only as pickles"):
        make_run(recipe, tmp_path)
    assert not (tmp_path / "PWNED").exists()
