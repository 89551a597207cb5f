"""Stages shared by the private nonsmooth nonconvex optimizers (ZTC 2024 and KLT 2024).

* samplers: ``single_pass`` (disjoint batches, B1 at period starts, B2 otherwise);
* estimators: ``zo_sphere`` (GRAD / DIFF or independent-central increments), ``fo_ball``
  (first order on the α-ball), ``zo_sphere_grad`` (the naive oracle);
* privatizers: ``tree_aggregation`` (binary mechanism), ``iid_prefix`` (KLT Alg. 4),
  ``bounded_gaussian`` (per step);
* update rule: ``o2nc`` (online-to-nonconvex conversion);
* accountant: ``zcdp_fail`` (zCDP plus concentration failure probabilities);
* objectives: ``l1_distance``, ``ring``, ``min_of_norms``.

The algorithms (presets) live in the two paper plugins, ``dpreg_ztc`` and ``dpreg_klt``.

This plugin is also a library for those two (issue 15: a plugin otherwise depends on dpregistry
alone). Its public API is ``__all__`` below, importable from the package itself; the paper
plugins import nothing else of it, and anything else may change without notice:

* the O2NC algorithm base (:class:`O2NCAlgorithm`: period clock, resets, closed-form plan) and
  the theorem helpers :func:`is_auto` and :func:`data_limit`;
* the typed values its stages exchange (:mod:`dpreg_nonsmooth.exchange`): :class:`O2NCSchedule`,
  :class:`Smoothing`, :class:`OracleBounds`, :class:`GradientBound`; a third-party stage may
  provide or need them like ours;
* the binary tree's node arithmetic that the papers' closed forms use (:func:`node_set`,
  :func:`paper_node_bound`; the nodes a record lies in, which accounting needs too, is
  dpregistry's ``privacy.events.tree_nodes_per_record``);
* the :class:`ConcentrationFailure` event.

Names other than the event are imported on first use (PEP 562), so that ``dpreg`` does not load
the stages' schemas or torch to list the plugins.
"""

from __future__ import annotations

import importlib

from dpregistry import StagePlugin

# importing registers the event type, so that any ledger naming it can be read back
from .accounting import ConcentrationFailure

#: public name -> the module that defines it
_PUBLIC = {
    "O2NCAlgorithm": ".algorithm", "is_auto": ".algorithm", "data_limit": ".algorithm",
    "O2NCSchedule": ".exchange", "Smoothing": ".exchange", "OracleBounds": ".exchange",
    "GradientBound": ".exchange",
    "node_set": ".tree", "paper_node_bound": ".tree",
}

__all__ = ["plugin", "ConcentrationFailure", *_PUBLIC]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


# Each stage is imported on first use (see dpregistry.registry).
plugin = StagePlugin(lazy={
    "objective": {
        "l1_distance": "dpreg_nonsmooth.objectives:L1Distance",
        "min_of_norms": "dpreg_nonsmooth.objectives:MinOfNorms",
        "ring": "dpreg_nonsmooth.objectives:Ring",
    },
    "sampler": {
        "single_pass": "dpreg_nonsmooth.samplers:SinglePass",
    },
    "estimator": {
        "fo_ball": "dpreg_nonsmooth.estimators:FOBall",
        "zo_sphere": "dpreg_nonsmooth.estimators:ZOSphere",
        "zo_sphere_grad": "dpreg_nonsmooth.estimators:ZOSphereGrad",
    },
    "privatizer": {
        "bounded_gaussian": "dpreg_nonsmooth.privatizers:BoundedGaussian",
        "iid_prefix": "dpreg_nonsmooth.privatizers:IidPrefix",
        "tree_aggregation": "dpreg_nonsmooth.privatizers:TreeAggregationPrivatizer",
    },
    "update_rule": {
        "o2nc": "dpreg_nonsmooth.update:O2NC",
    },
    "accountant": {
        "zcdp_fail": "dpreg_nonsmooth.accounting:ZcdpFailAccountant",
    },
})
