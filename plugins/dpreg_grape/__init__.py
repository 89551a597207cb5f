"""DP-GRAPE plugin (seed 003): projected per-example gradients, projected Adam/SGD, naive DP-GaLore.

Mulrooney et al., "Memory-Efficient Differentially Private Training with Gradient Random
Projection"; the implementation follows specs/003_dpgrape.md (section numbers cited in code).
"""

from dpregistry import hookimpl

from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .updates import UPDATE_RULES


@hookimpl
def dpreg_register_estimators(register):
    for cls in ESTIMATORS:
        register(cls)


@hookimpl
def dpreg_register_update_rules(register):
    for cls in UPDATE_RULES:
        register(cls)


@hookimpl
def dpreg_register_algorithms(register):
    for cls in ALGORITHMS:
        register(cls)


@hookimpl
def dpreg_register_objectives(register):
    for cls in OBJECTIVES:
        register(cls)
