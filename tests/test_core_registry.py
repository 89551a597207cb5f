"""The registry: our plugins load through entry points like anyone's; third-party plugins work."""

from __future__ import annotations

import json
import re
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

    def setup(self, ctx):
        self.noise_multiplier = 2 * self.cfg.noise_multiplier

    def clip_sum(self, contribution):
        return clip_and_sum(contribution, self.cfg.clip)

    def planned_events(self, z, ctx):
        return [Gaussian(std=z * self.cfg.clip, sensitivity=clipped_sum_sensitivity(self.cfg.clip, ctx.relation))]

    def release(self, total, ctx, *, std=None):
        std = self.noise_multiplier * self.cfg.clip if std is None else std
        total.aggregate.add_noise_(std, ctx.noise())
        total.aggregate.mul_(1 / ctx.expected_batch_size())
        return Release(total.aggregate, self.planned_events(std / self.cfg.clip, ctx))


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


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------
# lazy stages, names that differ only by case, broken plugins
# ------------------------------------------------------------------------------------------


class FullBatchImpostor(Privatizer):
    """A stage whose name is another registered name: stages tell each other apart by name."""

    name = "full_batch"


def test_a_stage_registered_under_another_name_than_its_own_is_refused():
    """O2NC and the KL algorithms test ``sampler.name == "full_batch"`` before charging a full-batch
    sensitivity: a Poisson sampler named full_batch but registered as my_poisson passed that test
    (a review: ρ = 0.5 printed, the releases' true ρ about 5000)."""
    from dpregistry.registry import PluginBroken

    class Plugin:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(FullBatchImpostor, name="my_privatizer")

    with pytest.raises(TypeError, match="registered as 'my_privatizer' but its name is 'full_batch'"):
        Registry().add_plugin(Plugin(), origin="spoof 1 (spoof)")

    class Lazy:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(f"{__name__}:FullBatchImpostor", name="my_privatizer")

    reg = Registry()
    reg.add_plugin(Lazy(), origin="spoof 1 (spoof)", name="spoof")
    with pytest.raises(PluginBroken, match="registered as 'my_privatizer' but its name is 'full_batch'"):
        reg.get("privatizer", "my_privatizer").cls


def test_malformed_plugins_are_refused_not_dropped():
    """A misspelt hook was never called, a class of no stage kind was skipped, and a schema on
    plain pydantic dropped a misspelt key (``noise_multipler: 20``) and ran with the default: each
    left only 'unknown privatizer' to go on. Each is now a broken plugin with its reason."""
    import pydantic

    from dpregistry import StagePlugin

    class Misspelt:
        @hookimpl
        def dpreg_register_privatizer(self, register):
            pass

    class Loose(Privatizer):
        """Its schema drops unknown keys."""

        name = "loose"

        class Params(pydantic.BaseModel):
            noise_multiplier: float = 1.0

    class NoKind:
        name = "no_kind"

    for plugin, reason in [(Misspelt(), "unknown hook 'dpreg_register_privatizer'"),
                           (StagePlugin(Loose), "Params must subclass dpregistry.stages.StageParams"),
                           (StagePlugin(NoKind), "subclasses no stage kind")]:
        reg = Registry()
        with pytest.raises(Exception, match=reason):
            reg.add_plugin(plugin, origin="bad 1 (bad)", name="bad")
        assert not reg.pm.has_plugin("bad")  # all or nothing


def test_every_lazily_registered_stage_loads_with_its_name_and_kind():
    """Our plugins name their stages as "module:Class" strings; each must import, subclass its
    kind's base and carry the name it is registered under (a drifted table is caught here)."""
    from dpregistry.registry import base_class

    entries = get_registry().all()
    assert len(entries) > 60 and all(isinstance(e.target, str) for e in entries)
    for e in entries:
        assert issubclass(e.cls, base_class(e.kind)) and e.cls.name == e.name, e.target
        assert not re.search(r"``|:[a-z]+:`", e.description), e.description  # `dpreg plugins` printed raw reST


def case_clash_plugin(target):
    class Plugin:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(target, name=None if isinstance(target, type) else "Gaussian")

    return Plugin()


class Shouting(Privatizer):
    """A name that differs from `gaussian` only by case."""

    name = "Gaussian"


@pytest.mark.parametrize("target", [Shouting, "elsewhere.module:Shouting"], ids=["class", "lazy"])
def test_a_name_that_differs_only_by_case_is_refused_naming_both(target):
    reg = Registry().load_entry_points()
    with pytest.raises(PluginConflict) as e:
        reg.add_plugin(case_clash_plugin(target), origin="shouty-plugin 1.0 (shouty)", name="shouty")
    msg = str(e.value)
    assert "'Gaussian'" in msg and "'gaussian'" in msg and "differs only by case" in msg
    assert "shouty-plugin 1.0 (shouty)" in msg and "dpregistry 0.1.0 (baseline)" in msg
    # nothing of the refused plugin stays behind
    assert not reg.pm.has_plugin("shouty") and reg.names("privatizer") == get_registry().names("privatizer")


def test_two_names_of_one_plugin_that_differ_only_by_case_are_refused():
    class Plugin:
        @hookimpl
        def dpreg_register_accountants(self, register):
            register("a.b:Mine", name="my_accountant")
            register("a.b:Mine", name="My_Accountant")

    with pytest.raises(PluginConflict, match="differs only by case from 'my_accountant'"):
        Registry().add_plugin(Plugin(), origin="mine 1 (mine)", name="mine")


def test_a_plugin_whose_hook_raises_leaves_the_registry_as_it_was():
    class Fine(Privatizer):
        """Registered before the hook fails."""

        name = "fine_but_doomed"

    class Plugin:
        @hookimpl
        def dpreg_register_privatizers(self, register):
            register(Fine)
            raise RuntimeError("the plugin's own bug")

    reg = Registry()
    with pytest.raises(RuntimeError, match="own bug"):
        reg.add_plugin(Plugin(), origin="buggy 1 (buggy)", name="buggy")
    assert reg.names("privatizer") == [] and not reg.pm.has_plugin("buggy")


def fake_distribution(root: Path, dist: str, module: str, source: str, obj: str = "") -> None:
    """An installed distribution without pip: importlib.metadata reads NAME-VERSION.dist-info
    folders on sys.path, and its entry_points.txt puts ``module`` in the dpregistry group."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[dpregistry]\n{module} = {module}{obj and ':' + obj}\n")


def dpreg_with(path: Path, *args, columns: int | None = None):
    """`python -m dpregistry ARGS` with ``path`` ahead of this environment's import path."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))}
    if columns:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "dpregistry", *args], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def broken_plugins(tmp_path_factory):
    """Two third-party plugins: one raises on import, one names a stage whose module is missing."""
    root = tmp_path_factory.mktemp("broken")
    fake_distribution(root, "dpreg-boom", "dpreg_boom", 'raise RuntimeError("boom at import")\n')
    fake_distribution(root, "dpreg-half", "dpreg_half", '''\
        from dpregistry import StagePlugin

        plugin = StagePlugin(lazy={"privatizer": {"half_gaussian": "dpreg_half.gone:HalfGaussian"}})
        ''', obj="plugin")
    return root


def validate_with_privatizer(root: Path, tmp_path: Path, name: str):
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        algorithm: dp_sgd
        objective: {{name: tabular, model: {{kind: linear}}, data: {{dataset: iris}}}}
        privatizer: {{name: {name}, clip: 1.0}}
        privacy: {{epsilon: 10.0, delta: 1.0e-3}}
        train: {{steps: 4}}
        """))
    return dpreg_with(root, "validate", str(recipe))


@pytest.mark.slow
def test_a_plugin_that_raises_on_import_is_reported_once_and_the_rest_keep_working(broken_plugins, tmp_path):
    warning = ("warning: plugin 'dpreg_boom' of dpreg-boom 1.0 failed to load and is skipped: "
               "RuntimeError: boom at import")
    listed = dpreg_with(broken_plugins, "plugins", columns=80)
    assert listed.returncode == 0 and listed.stderr.splitlines() == [warning]
    out = listed.stdout
    assert "broken plugins (1, not loaded)" in out and "dpreg_boom  dpreg-boom 1.0: RuntimeError: boom at import" in out
    assert "\n  gaussian " in out  # the others are listed as usual
    # the lazily registered stage whose module is missing is listed, marked broken
    assert "half_gaussian" in out and "broken: privatizer 'half_gaussian' of dpreg-half 1.0" in " ".join(out.split())

    calibrated = dpreg_with(broken_plugins, "privacy", "calibrate", "--epsilon", "3", "--delta", "1e-5",
                            "--steps", "100", "--sample-rate", "0.01", "--json")
    assert calibrated.returncode == 0 and calibrated.stderr.splitlines() == [warning]
    assert json.loads(calibrated.stdout)["epsilon"] <= 3.0

    # a recipe naming a stage that the broken plugin may have provided says so, in one line
    res = validate_with_privatizer(broken_plugins, tmp_path, "boom_gaussian")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    error = res.stderr.splitlines()[1:]
    assert len(error) == 1 and "unknown privatizer 'boom_gaussian'" in error[0]
    assert "'dpreg_boom' of dpreg-boom 1.0, which failed to load (RuntimeError: boom at import)" in error[0]


def test_a_recipe_naming_a_stage_that_fails_to_import_gets_one_line(broken_plugins, tmp_path):
    res = validate_with_privatizer(broken_plugins, tmp_path, "half_gaussian")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    (error,) = res.stderr.splitlines()[1:]
    assert error.startswith("error: ") and "privatizer 'half_gaussian' of dpreg-half 1.0 (dpreg_half) failed to " \
        "load (dpreg_half.gone:HalfGaussian): ModuleNotFoundError" in error


# ------------------------------------------------------------------------------------------
# `dpreg plugins` in a terminal
# ------------------------------------------------------------------------------------------


def test_plugins_are_grouped_by_kind_and_fit_80_columns_with_whole_names(tmp_path):
    from rich.cells import cell_len

    from dpregistry.registry import KINDS

    res = dpreg_with(tmp_path, "plugins", columns=80)
    assert res.returncode == 0 and res.stderr == ""
    lines = res.stdout.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    headings = [line.split(" (")[0] for line in lines if line and not line.startswith(" ") and "(" in line
                and not line.startswith("plugins of")]
    assert headings == [k.replace("_", " ") + "s" for k in KINDS]
    # each stage: its whole name, then its whole description (wrapped, never cut) and its plugin
    flowing = " ".join(res.stdout.split())
    for e in get_registry().all():
        assert f" {e.name} {' '.join(e.description.split())} ({e.plugin})" in flowing, e.name
        assert any(line.startswith(f"  {e.name} ") for line in lines)
    assert "plugins of dpregistry 0.1.0: accounting, baseline, dpzero, grape, kl, klt, nonsmooth, ztc" in flowing
