"""benchmarks/minilm_sst2_dev_search.py chose the MiniLM recipes' label descriptions by the
zero-shot accuracy of their heads, computed on features encoded once; that number must be the
accuracy the recipe's own step-0 model scores (the head ``head_init: label_descriptions`` builds)."""

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a heavy check, out of the default run (.ci/run runs -m slow)

REPO = Path(__file__).resolve().parents[1]


def test_the_searchs_zero_shot_accuracy_is_the_recipes_step_0_accuracy():
    spec = importlib.util.spec_from_file_location("dev_search", REPO / "benchmarks" / "minilm_sst2_dev_search.py")
    search = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(search)
    from dpregistry.api import load_recipe
    from dpregistry.run import Run

    sets = [f"data.path={REPO / 'tests' / 'data' / 'sst2'}", "data.k_per_class=8", "sampler.batch_size=8",
            "data.max_test=200"]
    obj = Run(load_recipe("minilm_sst2_dp_adam", sets)).prepare().objective
    neg, pos = yaml.safe_load((REPO / "recipes" / "minilm_sst2_dp_adam.yaml").read_text())["model"]["label_descriptions"]
    step0 = obj.evaluate()["accuracy"]
    assert 0.55 < step0 < 1  # a real zero-shot head on 200 sentences
    same, swapped = search.zero_shot_accuracies(obj, [f"{neg}|{pos}", f"{pos}|{neg}"])
    assert same == pytest.approx(step0, abs=1e-6)
    assert swapped == pytest.approx(1 - step0, abs=1e-6)  # the pair's order is the labels' order
