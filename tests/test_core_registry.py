"""The registry: our plugins load through entry points like anyone's; third-party plugins work."""

from __future__ import annotations

import json
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpregistry import Privatizer, hookimpl
from dpregistry.registry import PluginConflict, Registry, get_registry

BASELINE = {"poisson", "shuffle", "full_batch", "per_example_grad", "zo_two_point", "gaussian", "none",
            "sgd", "adam", "directional_sgd", "rdp", "pld", "zcdp", "rdp_filter", "dp_sgd", "dp_adam", "mezo",
            "tabular", "hf_text_classification", "quadratic", "standard"}


def test_our_plugins_come_from_the_entry_point_group():
    reg = get_registry()
    names = {e.name for e in reg.all()}
    assert BASELINE <= names
    gauss = reg.get("privatizer", "gaussian")
    assert gauss.origin.startswith("dpregistry ") and "(baseline)" in gauss.origin
    assert reg.get("accountant", "pld").origin.endswith("(accounting)")


def test_duplicate_name_names_both_distributions():
    class Dup(Privatizer):
        """A clash."""

        name = "gaussian"

    class Plugin:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(Dup)

    reg = Registry().load_entry_points()
    with pytest.raises(PluginConflict) as e:
        reg.add_plugin(Plugin(), origin="evil-plugin 9.9 (evil)")
    msg = str(e.value)
    assert "dpregistry 0.1.0 (baseline)" in msg and "evil-plugin 9.9 (evil)" in msg


def test_register_rejects_a_class_of_the_wrong_kind():
    class NotAPrivatizer:
        name = "x"

    class Plugin:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(NotAPrivatizer)

    with pytest.raises(TypeError, match="must subclass"):
        Registry().add_plugin(Plugin(), origin="bad 0 (bad)")


PLUGIN = '''
import math
from pydantic import Field
from dpregistry import Privatizer, Release, StageParams, hookimpl
from dpregistry.clipping import clip_and_sum
from dpregistry.privacy.events import Gaussian, clipped_sum_sensitivity


class Params(StageParams):
    clip: float = Field(gt=0)
    noise_multiplier: float = Field(gt=0)


class DoubledGaussian(Privatizer):
    """Third-party test privatizer: Gaussian noise at twice the configured multiplier."""

    name = "{name}"
    Params = Params

    def setup(self, run):
        self.noise_multiplier = 2 * self.cfg.noise_multiplier

    def clip_sum(self, contribution):
        return clip_and_sum(contribution, self.cfg.clip)

    def planned_events(self, z, run):
        return [Gaussian(std=z * self.cfg.clip, sensitivity=clipped_sum_sensitivity(self.cfg.clip, run.relation))]

    def release(self, total, run, *, std=None):
        std = self.noise_multiplier * self.cfg.clip if std is None else std
        total.aggregate.add_noise_(std, run.noise())
        total.aggregate.mul_(1 / run.sampler.expected_batch_size(run))
        return Release(total.aggregate, self.planned_events(std / self.cfg.clip, run))


@hookimpl
def dpreg_register_privatizers(register):
    register(DoubledGaussian)
'''


def make_package(root: Path, dist: str, module: str, privatizer: str) -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(PLUGIN.replace("{name}", privatizer))
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [project.entry-points.dpregistry]
        {module} = "{module}"

        [tool.setuptools]
        packages = ["{module}"]
        """))
    return pkg


@pytest.fixture(scope="module")
def plugin_venv(tmp_path_factory):
    """A throwaway venv that sees this environment's packages and holds the test plugins."""
    root = tmp_path_factory.mktemp("thirdparty")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    inner_site = Path(subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages())
    (inner_site / "outer.pth").write_text(lines)
    return root, py


def pip_install(py: Path, pkg: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", str(pkg)], check=True, capture_output=True)


def dpreg(py: Path, *args, cwd=None):
    return subprocess.run([str(py), "-m", "dpregistry", *args], capture_output=True, text=True, cwd=cwd)


def test_a_pip_installed_plugin_is_used_in_a_recipe(plugin_venv, tmp_path):
    root, py = plugin_venv
    pip_install(py, make_package(root, "dpreg-demo-plugin", "dpreg_demo_plugin", "doubled_gaussian"))
    listed = json.loads(dpreg(py, "plugins", "--json").stdout)
    demo = [e for e in listed if e["name"] == "doubled_gaussian"]
    assert demo and demo[0]["kind"] == "privatizer" and demo[0]["origin"].startswith("dpreg-demo-plugin 0.0.1")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(textwrap.dedent("""\
        algorithm: dp_sgd
        objective: {name: tabular, model: {kind: linear}, data: {dataset: iris}}
        sampler: {name: poisson, batch_size: 16}
        privatizer: {name: doubled_gaussian, clip: 1.0, noise_multiplier: 2.0}
        privacy: {epsilon: 10.0, delta: 1.0e-3}
        train: {steps: 4}
        """))
    out = tmp_path / "out"
    res = dpreg(py, "run", str(recipe), "--out", str(out), "-q")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["noise_multiplier"] == 4.0  # the plugin's own setup ran
    assert summary["step"] == 4 and summary["epsilon"] <= 10.0
    assert any("dpreg-demo-plugin" in p for p in summary["versions"]["plugins"])


def test_a_second_plugin_with_a_taken_name_is_refused_naming_both(plugin_venv):
    root, py = plugin_venv
    pip_install(py, make_package(root, "dpreg-clash-plugin", "dpreg_clash_plugin", "gaussian"))
    res = dpreg(py, "plugins")
    assert res.returncode == 2
    assert "dpreg-clash-plugin 0.0.1" in res.stderr and "dpregistry 0.1.0 (baseline)" in res.stderr
    assert "Traceback" not in res.stderr
