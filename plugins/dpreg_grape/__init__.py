"""DP-GRAPE plugin (seed 003): projected per-example gradients, projected Adam/SGD, naive DP-GaLore.

Mulrooney et al., "Memory-Efficient Differentially Private Training with Gradient Random
Projection"; the implementation follows specs/003_dpgrape.md (section numbers cited in code).
"""

from dpregistry import StagePlugin

from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .updates import UPDATE_RULES

plugin = StagePlugin(*OBJECTIVES, *ESTIMATORS, *UPDATE_RULES, *ALGORITHMS)
