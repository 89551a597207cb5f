"""dpregistry: a registry of differentially private optimizers for PyTorch.

The public API for plugin authors is re-exported here: the stage contracts, the coordinate
spaces, privacy events and the ``hookimpl`` marker.
"""

__version__ = "0.1.0"

from .errors import BudgetExhausted, UserError  # noqa: E402
from .hookspecs import hookimpl  # noqa: E402
from .stages import (Algorithm, Charge, ClippedSum, Estimator, Objective, Privatizer,  # noqa: E402
                     Release, Sampler, Stage, StageParams, StepResult, UpdateRule)
from .privacy.accountant import Accountant, Budget  # noqa: E402
from .privacy import events  # noqa: E402
from . import spaces  # noqa: E402
from .registry import StagePlugin  # noqa: E402

__all__ = [
    "__version__", "hookimpl", "UserError", "BudgetExhausted",
    "Stage", "StageParams", "Objective", "Sampler", "Estimator", "Privatizer", "UpdateRule",
    "Accountant", "Algorithm", "Budget", "Charge", "ClippedSum", "Release", "StepResult",
    "events", "spaces", "StagePlugin",
]
