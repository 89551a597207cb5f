"""Helpers for the nonsmooth plugin tests: host runs and direct oracle queries."""

from __future__ import annotations

import copy

import torch

from conftest import make_run
from dpreg_nonsmooth.points import PointQueries


def recipe(algorithm="ztc_o2nc_tree", objective=None, **sections):
    rec = {"algorithm": algorithm if isinstance(algorithm, dict) else {"name": algorithm},
           "objective": objective or {"name": "l1_distance", "dim": 5, "n": 2000},
           "train": {"steps": 100_000, "log_every": 100_000}}
    for k, v in sections.items():
        rec[k] = v
    return copy.deepcopy(rec)


def host(tmp_path, dim=5, objective=None, estimator=None, algorithm=None, update=None, **extra):
    """A prepared non-private run whose stages the tests call directly."""
    alg = algorithm or {"name": "ztc_o2nc_tree", "episode_len": 4}
    rec = recipe(alg, objective or {"name": "l1_distance", "dim": dim, "n": 4000},
                 estimator={"smooth_radius": 0.2, **(estimator or {})},
                 privatizer={"noise_multiplier": 0.0},
                 update={"radius": 0.2, "window": 1, **(update or {})}, **extra)
    return make_run(rec, tmp_path)


def per_example(run, x, indices, prev=None, step=0, query=None):
    """The estimator's per-example contributions at x (and prev for a VR increment), flat [B, d]."""
    est = run.estimator
    if query is not None:
        est.query = query
    run.step = step
    est.view.write_(run.params, x)
    est.state.prev = None if prev is None else prev.clone().to(est.view.dtype)
    (c,) = list(est.contributions(run.objective, torch.as_tensor(indices), run.begin_step()))
    flat = torch.cat([c.per_example[n].reshape(len(indices), -1) for n in est.view.names], 1)
    return flat, c


class Stub(PointQueries):
    """A point objective given by a loss f(points, data) and its gradient, data per record."""

    def __init__(self, f, grad=None, data=None):
        self.f, self.g, self.data = f, grad, data
        self.calls = []

    def losses_at(self, points, indices):
        self.calls.append(("loss", len(points)))
        return self.f(points, None if self.data is None else self.data[indices])

    def grads_at(self, points, indices):
        self.calls.append(("grad", len(points)))
        return self.g(points, None if self.data is None else self.data[indices])
