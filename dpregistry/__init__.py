"""dpregistry: a registry of differentially private optimizers for PyTorch.

The public API for plugin authors is re-exported here: the stage contracts, the coordinate
spaces, privacy events and the ``hookimpl`` marker.

Names other than the errors and ``hookimpl`` are imported on first use (PEP 562): the CLI imports
this package for every command, and ``dpreg --help`` or ``dpreg privacy calibrate`` must not pay
for pydantic's stage schemas or for torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from .errors import BudgetExhausted, UserError  # noqa: E402
from .hookspecs import hookimpl  # noqa: E402

#: public name -> the module that defines it (a module itself when the name is the module's)
_LAZY = {
    **dict.fromkeys(["Algorithm", "Charge", "ClippedSum", "Estimator", "NoiseStd", "Objective", "Privatizer",
                     "Release", "Sampler", "Stage", "StageParams", "Stages", "StepResult", "UpdateRule"], ".stages"),
    "Context": ".context",
    "checkpoint_blocks": ".objectives",
    **dict.fromkeys(["train", "resume", "Result", "Stopped", "Terminated"], ".api"),
    "Accountant": ".privacy.accountant",
    "Budget": ".privacy.accountant",
    "StagePlugin": ".registry",
    "events": ".privacy.events",
    "spaces": ".spaces",
}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    value = module if where.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__", "hookimpl", "UserError", "BudgetExhausted",
    "Stage", "StageParams", "Objective", "Sampler", "Estimator", "Privatizer", "UpdateRule",
    "Accountant", "Algorithm", "Budget", "Charge", "ClippedSum", "NoiseStd", "Release", "StepResult",
    "Stages", "Context", "events", "spaces", "StagePlugin", "train", "resume", "Result", "Stopped", "Terminated",
    "checkpoint_blocks",
]
