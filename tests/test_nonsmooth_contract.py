"""The nonsmooth plugins keep the stage contract (issue 15): stages exchange declared, typed values,
only an algorithm's step sees the run, and the paper plugins use dpreg_nonsmooth's public API only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dpreg_nonsmooth
from dpregistry import UserError

from conftest import REPO, make_run
from nonsmooth_helpers import recipe

PLUGINS = {name: REPO / "plugins" / name for name in ("dpreg_nonsmooth", "dpreg_ztc", "dpreg_klt")}


def _modules(*names: str):
    for name in names:
        for path in sorted(PLUGINS[name].glob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _functions_around(tree: ast.AST) -> dict[ast.AST, ast.FunctionDef | None]:
    """Every node -> the innermost function definition that contains it."""
    out: dict[ast.AST, ast.FunctionDef | None] = {}

    def visit(node, fn):
        out[node] = fn
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
        for child in ast.iter_child_nodes(node):
            visit(child, inner)
    visit(tree, None)
    return out


def test_only_an_algorithm_step_sees_the_run():
    """No stage method but ``step(self, run)`` names the run; no getattr/hasattr probes a stage (the
    one getattr left is the package's PEP 562 ``__getattr__``, which imports its public names)."""
    for path, tree in _modules(*PLUGINS):
        around = _functions_around(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "run":
                fn = around[node]
                assert fn is not None and fn.name == "step", f"{path.name}:{node.lineno} uses the run"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                fn = around[node]
                assert fn is not None and fn.name == "__getattr__" and path.name == "__init__.py", \
                    f"{path.name}:{node.lineno} calls {node.func.id}"


def test_the_paper_plugins_import_only_the_library_api_of_dpreg_nonsmooth():
    """dpreg_ztc and dpreg_klt import other plugins only as ``from dpreg_nonsmooth import X`` with X in
    its ``__all__``, and every name there resolves (the lazy table points at real definitions)."""
    public = set(dpreg_nonsmooth.__all__)
    used = set()
    for path, tree in _modules("dpreg_ztc", "dpreg_klt"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("dpreg_") for a in node.names), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("dpreg_"):
                assert node.module == "dpreg_nonsmooth", f"{path.name}:{node.lineno} imports {node.module}"
                names = {a.name for a in node.names}
                assert names <= public, f"{path.name}:{node.lineno} imports {sorted(names - public)}"
                used |= names
    assert {"O2NCAlgorithm", "O2NCSchedule"} <= used  # the check saw the imports it is about
    for name in public:
        assert getattr(dpreg_nonsmooth, name) is not None
    assert dpreg_nonsmooth.O2NCSchedule.__module__ == "dpreg_nonsmooth.exchange"


@pytest.mark.parametrize("sections, stage, needs", [
    # the single-pass sampler follows an O2NC period clock; a standard step has none
    ({"algorithm": {"name": "standard"}, "sampler": {"name": "single_pass", "batch_first": 4, "batch_rest": 1},
      "estimator": {"name": "per_example_grad"}, "privatizer": {"name": "gaussian", "clip": 1.0},
      "update": {"name": "sgd", "lr": 0.1}, "accountant": "rdp"}, "sampler 'single_pass'", "O2NCSchedule"),
    # an oracle reads D, m and δ_fail from the O2NC schedule
    ({"algorithm": {"name": "standard"}, "sampler": {"name": "full_batch"},
      "estimator": {"name": "zo_sphere_grad", "smooth_radius": 0.1}, "privatizer": {"name": "gaussian", "clip": 1.0},
      "update": {"name": "sgd", "lr": 0.1}, "accountant": "rdp"}, "estimator 'zo_sphere_grad'", "O2NCSchedule"),
    # the O2NC algorithms need an oracle's smoothing radius and Lipschitz constant
    ({"algorithm": {"name": "ztc_naive", "episode_len": 4}, "estimator": {"name": "per_example_grad"}},
     "algorithm 'ztc_naive'", "Smoothing"),
])
def test_a_stage_whose_needs_no_stage_provides_is_refused_before_any_work(tmp_path, sections, stage, needs):
    rec = recipe(privacy={"rho": 0.5, "delta": 1e-6})
    rec.update(sections)
    with pytest.raises(UserError, match=f"{stage} needs {needs}, which no stage of this recipe provides"):
        make_run(rec, tmp_path)


def test_the_algorithm_refuses_stages_it_cannot_drive(tmp_path):
    """The O2NC algorithm composes the o2nc update rule and a stream privatizer over public bounds."""
    base = recipe({"name": "ztc_naive", "episode_len": 4}, privacy={"rho": 0.5, "delta": 1e-6})
    with pytest.raises(UserError, match="needs the o2nc update rule, got 'sgd'"):
        make_run({**base, "update": {"name": "sgd", "lr": 0.1}}, tmp_path)
    with pytest.raises(UserError, match="needs a stream privatizer .* got 'gaussian'"):
        make_run({**base, "privatizer": {"name": "gaussian", "clip": 1.0}}, tmp_path)


def test_every_nonsmooth_stage_declares_what_it_reads():
    """The exchanges are declared on the classes (the run checks them before any setup)."""
    from dpreg_nonsmooth.algorithm import O2NCAlgorithm
    from dpreg_nonsmooth.estimators import ESTIMATORS
    from dpreg_nonsmooth.exchange import GradientBound, O2NCSchedule, OracleBounds, Smoothing
    from dpreg_nonsmooth.privatizers import PRIVATIZERS
    from dpreg_nonsmooth.samplers import SinglePass
    from dpreg_nonsmooth.update import O2NC

    assert set(O2NCAlgorithm.provides) == {O2NCSchedule, GradientBound}
    assert {Smoothing, OracleBounds} <= set(O2NCAlgorithm.needs)
    assert all({Smoothing, OracleBounds} == set(e.provides) and O2NCSchedule in e.needs for e in ESTIMATORS)
    assert all({O2NCSchedule, OracleBounds} <= set(p.needs) for p in PRIVATIZERS)
    assert O2NCSchedule in SinglePass.needs and set(O2NC.needs) == {O2NCSchedule, GradientBound}
    assert Path(dpreg_nonsmooth.__file__).parent == PLUGINS["dpreg_nonsmooth"]
