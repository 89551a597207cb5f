"""Adam's arithmetic in place, shared by the update rules of the Adam form (DP-GRAPE Alg. 2/3).

m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², then x ← x − α·m/(√v + eps). Every operation is
elementwise, so ``sub_ratio_`` works a block of elements at a time with the numbers of the
whole-tensor operations bit for bit, and the ratio m/(√v + eps) never exists at the parameter's
size (for an embedding table that transient was hundreds of MiB).
"""

from __future__ import annotations

import functools
import math

import torch

#: elements per block of an in-place update (``sub_ratio_``, ``Projector.sub_back_``): 4 MiB of fp32
BLOCK = 1 << 20


def step_size(lr: float, betas: tuple[float, float], t: int) -> float:
    """α_t = lr·√(1−β2^t)/(1−β1^t): Adam's bias correction folded into the step (Alg. 3)."""
    return lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)


def update_moments_(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, betas: tuple[float, float]) -> None:
    b1, b2 = betas
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)


def ratio(m: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """m/(√v + eps) in one new tensor (``m / (v.sqrt() + eps)`` allocates three)."""
    out = v.sqrt()
    return torch.div(m, out.add_(eps), out=out)


def noise_corrected_ratio(m: torch.Tensor, v: torch.Tensor, v_scale: float, phi: float, floor: float) -> torch.Tensor:
    """m/√max(v/v_scale − Φ, γ') in one new tensor: DP-AdamBC's step direction (see ``sub_ratio_``)."""
    out = v.div(v_scale).sub_(phi).clamp_(min=floor).sqrt_()
    return torch.div(m, out, out=out)


def sub_ratio_(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, eps: float, alpha: float,
               noise: tuple[float, float, float] | None = None) -> None:
    """x ← x − α·m/(√v + eps) in place, ``BLOCK`` elements at a time; x may be narrower than m.

    ``noise = (v_scale, Φ, γ')``: x ← x − α·m/√max(v/v_scale − Φ, γ') instead (DP-AdamBC; eps unused).
    """
    if noise is None:
        direction = functools.partial(ratio, eps=eps)
    else:
        direction = functools.partial(noise_corrected_ratio, v_scale=noise[0], phi=noise[1], floor=noise[2])
    if not all(t.is_contiguous() for t in (x, m, v)):
        x.sub_(direction(m, v).mul_(alpha).to(x.dtype))
        return
    xs, ms, vs = x.view(-1), m.view(-1), v.view(-1)
    for i in range(0, xs.numel(), BLOCK):
        xs[i:i + BLOCK].sub_(direction(ms[i:i + BLOCK], vs[i:i + BLOCK]).mul_(alpha).to(x.dtype))
