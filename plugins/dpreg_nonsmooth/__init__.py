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
"""

from dpregistry import StagePlugin

# importing registers the event type, so that any ledger naming it can be read back
from .accounting import ConcentrationFailure

__all__ = ["ConcentrationFailure", "plugin"]

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
