"""Baseline plugin: DP-SGD, DP-Adam and MeZO with their samplers, estimators and update rules."""

from dpregistry import StagePlugin

from .algorithms import ALGORITHMS
from .estimators import ESTIMATORS
from .objectives import OBJECTIVES
from .privatizers import PRIVATIZERS
from .samplers import SAMPLERS
from .updates import UPDATE_RULES

plugin = StagePlugin(*OBJECTIVES, *SAMPLERS, *ESTIMATORS, *PRIVATIZERS, *UPDATE_RULES, *ALGORITHMS)
