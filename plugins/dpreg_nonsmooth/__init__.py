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

from .accounting import ACCOUNTANTS, ConcentrationFailure  # importing registers the event type
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .privatizers import PRIVATIZERS
from .samplers import SAMPLERS
from .update import UPDATE_RULES

__all__ = ["ConcentrationFailure", "plugin"]

plugin = StagePlugin(*OBJECTIVES, *SAMPLERS, *ESTIMATORS, *PRIVATIZERS, *UPDATE_RULES, *ACCOUNTANTS)
