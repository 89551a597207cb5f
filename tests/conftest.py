"""Shared fixtures. Nothing here (or anywhere in the suite) downloads: the hub is off."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# datasets keeps an Arrow copy of every data file it reads: the suite's go to a folder of its own
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="dpreg-tests-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)

import pytest  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Triton's interpreter, set when Triton is first imported: test_triton_kernels.py runs this folder
# in a process of its own
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreted"]
RECIPES = REPO / "recipes"


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test leaves the environment as it found it: one that runs the CLI's entry point in this
    process (``cli.main`` sets the Hugging Face libraries' quiet defaults) made a later test that
    imported huggingface_hub read HF_HUB_DISABLE_PROGRESS_BARS=1."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


#: 1,024 training and 300 test rows of SST-2, shipped with the tests (see tests/data/README.md)
SST2_SUBSET = REPO / "tests" / "data" / "sst2"


def sst2_path() -> Path:
    """SST-2 for tests: $DPREG_SST2_DIR (a full copy) when set, else the subset in tests/data."""
    env = os.environ.get("DPREG_SST2_DIR")
    return Path(env) if env else SST2_SUBSET


@pytest.fixture(scope="session")
def sst2_dir() -> Path:
    """A folder with train.tsv and test.tsv (sentence<TAB>label), at least 512 rows per class in
    train.tsv. Tests that assert numbers which depend on the rows use ``SST2_SUBSET`` itself."""
    p = sst2_path()
    if not (p / "train.tsv").is_file() or not (p / "test.tsv").is_file():
        pytest.fail(f"DPREG_SST2_DIR={p} has no train.tsv and test.tsv; unset it to use the subset in tests/data")
    return p


def write_recipe(tmp_path: Path, recipe: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False))
    return path


def make_run(recipe: dict | str | Path, tmp_path: Path | None = None, sets=(), out: Path | None = None,
             registry=None):
    """A prepared Run for a recipe dict/text/path (no output folder unless ``out``); ``registry``
    resolves the stage names (default: the installed plugins)."""
    from dpregistry.folder import start_run
    from dpregistry.run import Run
    from dpregistry.recipe import load

    if not isinstance(recipe, Path):
        recipe = write_recipe(tmp_path, recipe)
    run = Run(load(recipe, list(sets), registry)).prepare()
    if out is not None:
        start_run(run, out)
    return run


class Crash(Exception):
    """A crash raised inside a run's loop (``crash_at``)."""


def crash_at(run, step: int) -> None:
    """Train ``run`` until it crashes as step ``step`` ends (before that step's checkpoint)."""
    def crash(r, metrics):
        if r.step == step:
            raise Crash

    with pytest.raises(Crash):
        run.train(progress=crash)


def rewind(run_dir: Path, step: int) -> None:
    """Make a finished run look as a crash after ``step`` leaves it: later checkpoints, their ledger
    lines, the summary and the model gone."""
    import json

    from dpregistry import checkpoint as ckpt

    for s, p in ckpt.list_checkpoints(run_dir / "checkpoints"):
        if s > step:
            p.unlink()
    ledger = run_dir / "ledger.jsonl"
    lines = ledger.read_text().splitlines(keepends=True)
    ledger.write_text("".join(x for x in lines if json.loads(x)["step"] <= step))
    for name in ("summary.json", "model.safetensors"):
        (run_dir / name).unlink()


@pytest.fixture
def recipe_file(tmp_path):
    return lambda recipe, name="recipe.yaml": write_recipe(tmp_path, recipe, name)


@pytest.fixture
def fp64():
    """float64 as torch's default dtype for the test (``pytestmark = pytest.mark.usefixtures("fp64")``
    for a whole module): exact comparisons with per-example autograd."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def setup_probes(monkeypatch) -> list:
    """A list that is not empty while the run's setup checks run (GradSampler.check_model: the
    layout check and the mixing probes; StateWatch.check: the probe forward of the model's state),
    for tests that count the calls of a run's steps."""
    from dpregistry.persample import GradSampler, StateWatch

    probing = []

    def probe(real):
        def check(self, *args, **kwargs):
            probing.append(True)
            try:
                return real(self, *args, **kwargs)
            finally:
                probing.pop()
        return check

    monkeypatch.setattr(GradSampler, "check_model", probe(GradSampler.check_model))
    monkeypatch.setattr(StateWatch, "check", probe(StateWatch.check))
    return probing


def held_out_tsv(tsv: str) -> str:
    """Held-out rows for a TSV's training rows: "the " before each text (a run refuses a held-out
    set of training texts)."""
    head, *rows = tsv.splitlines(keepends=True)
    return head + "".join("the " + r for r in rows)
