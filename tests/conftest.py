"""Shared fixtures. Nothing here (or anywhere in the suite) downloads: the hub is off."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def sst2_path() -> Path:
    """SST-2 for tests: $DPREG_SST2_DIR, else ../shared/data/sst2 beside the checkout (CI)."""
    env = os.environ.get("DPREG_SST2_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data" / "sst2"


@pytest.fixture(scope="session")
def sst2_dir() -> Path:
    p = sst2_path()
    if not (p / "train.tsv").exists():
        pytest.fail(f"SST-2 not found at {p}; set DPREG_SST2_DIR to a folder with train.tsv and test.tsv")
    return p


def write_recipe(tmp_path: Path, recipe: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False))
    return path


def make_run(recipe: dict | str | Path, tmp_path: Path | None = None, sets=(), out: Path | None = None,
             registry=None):
    """A prepared Run for a recipe dict/text/path (no output folder unless ``out``); ``registry``
    resolves the stage names (default: the installed plugins)."""
    from dpregistry.engine import Run, start_run
    from dpregistry.recipe import load

    if not isinstance(recipe, Path):
        recipe = write_recipe(tmp_path, recipe)
    run = Run(load(recipe, list(sets), registry), None).prepare()
    if out is not None:
        start_run(run, out)
    return run


@pytest.fixture
def recipe_file(tmp_path):
    return lambda recipe, name="recipe.yaml": write_recipe(tmp_path, recipe, name)
