"""KL-condition plugin (spec 004): KL-Spider, private proximal point, adaptive noisy GD with a filter.

Objectives with known KL constants (the axis-design least squares and quartic, ridge least squares
and logistic regression on scikit-learn's bundled tables), full-batch estimators (per-record
gradients; SPIDER's anchor and differences), per-call Gaussian privatizers, and the update rules
of Alg. 1 (normalised steps) and Alg. 4 (projected GD with a weighted average).
"""

from dpregistry import StagePlugin

from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .privatizers import PRIVATIZERS
from .updates import UPDATE_RULES

plugin = StagePlugin(*OBJECTIVES, *ESTIMATORS, *PRIVATIZERS, *UPDATE_RULES, *ALGORITHMS)
