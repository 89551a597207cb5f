"""The iterates' moving average as an update rule's output (``average: β``), shared by the rules
that offer it (``sgd``, ``adam``, ``projected_adam``).

The run outputs (scores, writes) x̄_t = Σ_i (1−β)β^(t−i)·x_i / (1−β^t), the iterates' exponential
moving average, in place of the last iterate x_t (De, Berrada, Hayes, Smith & Balle 2022 average
DP-SGD's iterates the same way: the privacy noise of the last steps partly cancels). It is computed
from released iterates only, so it is post-processing: the privacy is unchanged. The steps are
unchanged too, and so are held-out metrics during the run, which score the iterate. It keeps one
copy of the trainable parameters (fp32 or wider), checkpointed with the rule's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pydantic import Field

from .spaces import acc_dtype
from .stages import StageParams


class AveragingParams(StageParams):
    average: float | None = Field(
        default=None, gt=0, lt=1, description="output the exponential moving average of the iterates with this "
                                              "decay (bias-corrected: the starting point has no weight) in place of "
                                              "the last iterate (post-processing, so the privacy is unchanged)")


@dataclass
class AverageState:
    average: dict[str, torch.Tensor] = field(default_factory=dict)  # Σ (1−β)β^(t−i)·x_i, by parameter
    averaged: int = 0                                                # t: iterates in it


class AveragesIterates:
    """Mixin of an update rule whose Params extend AveragingParams and whose State extends
    AverageState: ``apply`` calls ``_average_(params)`` after its step."""

    def _average_(self, params: dict[str, torch.Tensor]) -> None:
        if self.cfg.average is None:
            return
        s = self.state
        s.averaged += 1
        for k, x in params.items():
            avg = s.average.setdefault(k, torch.zeros_like(x, dtype=acc_dtype(x.dtype)))
            avg.lerp_(x.to(avg.dtype), 1 - self.cfg.average)

    def output(self, params, ctx):
        if self.cfg.average is None or not self.state.averaged:
            return None
        weight = 1 - self.cfg.average ** self.state.averaged
        return {k: (a / weight).to(params[k].dtype) for k, a in self.state.average.items()}
