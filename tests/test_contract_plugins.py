"""The plugin guide proves the contract (issue 15): the README's third-party privatizer and
estimator, installed with pip from a temporary package, run mixed with shipped stages, using only
the documented context."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, rewind
from dpregistry import checkpoint as ckpt


def guide_blocks() -> dict[str, list[str]]:
    """The fenced code blocks of README's "Writing a plugin", by language."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Writing a plugin"):]
    section = section[:section.index("\n## ", 3)]
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S):
        blocks.setdefault(lang, []).append(body)
    return blocks


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install` of the guide's package into a folder of its own (no network, no build isolation)."""
    blocks = guide_blocks()
    src = tmp_path_factory.mktemp("my-dp-stages")
    (src / "pyproject.toml").write_text(blocks["toml"][0] + '\n[build-system]\nrequires = ["setuptools"]\n'
                                        'build-backend = "setuptools.build_meta"\n')
    (src / "my_stages").mkdir()
    (src / "my_stages" / "__init__.py").write_text("\n".join(blocks["python"]))
    site = tmp_path_factory.mktemp("site")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (site / "my_stages" / "__init__.py").exists()
    return site, blocks["yaml"][0]


def dpreg(site: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *sys.path]))
    return subprocess.run([sys.executable, "-m", "dpregistry", *map(str, args)], capture_output=True, text=True,
                          env=env)


def test_the_guide_uses_only_the_documented_context():
    code = "\n".join(guide_blocks()["python"])
    assert "run." not in code and "run)" not in code  # stages never see the run
    assert not re.search(r"\b(getattr|hasattr)\(", code)


@pytest.mark.slow
def test_the_installed_estimator_and_privatizer_run_with_shipped_stages(installed, tmp_path):
    site, recipe = installed
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    listed = dpreg(site, "plugins", "--json")
    names = {e["name"]: e for e in json.loads(listed.stdout)}
    assert names["my_clipped_gaussian"]["kind"] == "privatizer" and names["my_one_sided"]["kind"] == "estimator"
    assert "my-dp-stages" in names["my_one_sided"]["origin"]
    res = dpreg(site, "run", path, "--out", tmp_path / "run", "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 50 and summary["epsilon"] <= 3.0 and summary["noise"] == "secure"
    assert summary["noise_multiplier"] > 0  # calibrated by the run through the privatizer's base class
    _, meta = ckpt.read(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1])
    assert meta["state"]["estimator"]["evaluations"] > 0  # the declared State is checkpointed


@pytest.mark.slow
def test_the_installed_estimator_resumes_bit_for_bit(installed, tmp_path):
    site, recipe = installed
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe + "seed: 3\n")
    sets = ["--set", "privacy.noise=reproducible", "--set", "train.checkpoint_every=10", "--set",
            "train.keep_checkpoints=10"]
    assert dpreg(site, "run", path, "--out", tmp_path / "a", "-q", *sets).returncode == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    rewind(tmp_path / "b", 20)  # as a crash after step 20 would leave it
    res = dpreg(site, "resume", tmp_path / "b", "-q")
    assert res.returncode == 0, res.stderr[-3000:]
    a, _ = ckpt.read(tmp_path / "a" / "model.safetensors", verify=True)
    b, _ = ckpt.read(tmp_path / "b" / "model.safetensors", verify=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_installed_privatizer_is_the_shipped_gaussian_bit_for_bit(installed, tmp_path):
    """Mixed into DP-Adam, the guide's privatizer calibrates, noises and charges exactly as the
    shipped `gaussian` privatizer does."""
    site, _ = installed
    base = ("algorithm: dp_adam\nseed: 1\nobjective: {name: tabular, model: {kind: mlp, hidden: [16]}, "
            "data: {dataset: wine}}\nsampler: {name: poisson, batch_size: 32}\nupdate: {lr: 0.01}\n"
            "accountant: rdp\nprivacy: {epsilon: 4.0, delta: 1.0e-5, noise: reproducible}\ntrain: {steps: 12}\n")
    for name in ("gaussian", "my_clipped_gaussian"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(base + f"privatizer: {{name: {name}, clip: 1.5}}\n")
        res = dpreg(site, "run", path, "--out", tmp_path / name, "-q")
        assert res.returncode == 0, res.stderr[-3000:]
    shipped, _ = ckpt.read(tmp_path / "gaussian" / "model.safetensors")
    mine, _ = ckpt.read(tmp_path / "my_clipped_gaussian" / "model.safetensors")
    assert all(torch.equal(shipped[k], mine[k]) for k in shipped)
    s1, s2 = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("gaussian", "my_clipped_gaussian"))
    assert s1["epsilon"] == s2["epsilon"] and s1["noise_multiplier"] == s2["noise_multiplier"]
