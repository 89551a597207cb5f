"""Baseline plugin: DP-SGD, DP-Adam and MeZO with their samplers, estimators and update rules."""

from dpregistry import hookimpl

from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .privatizers import PRIVATIZERS
from .samplers import SAMPLERS
from .updates import UPDATE_RULES


@hookimpl
def dpreg_register_objectives(register):
    for cls in OBJECTIVES:
        register(cls)


@hookimpl
def dpreg_register_samplers(register):
    for cls in SAMPLERS:
        register(cls)


@hookimpl
def dpreg_register_estimators(register):
    for cls in ESTIMATORS:
        register(cls)


@hookimpl
def dpreg_register_privatizers(register):
    for cls in PRIVATIZERS:
        register(cls)


@hookimpl
def dpreg_register_update_rules(register):
    for cls in UPDATE_RULES:
        register(cls)


@hookimpl
def dpreg_register_algorithms(register):
    for cls in ALGORITHMS:
        register(cls)
