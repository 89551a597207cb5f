"""Gaussian noise from the operating system's entropy (``privacy.secure_noise: true``).

What it protects against:

* predicting or replaying the noise: no seed exists, so knowing the recipe, the run seed, the
  public direction/projector seeds or an earlier checkpoint does not reveal a single draw;
* the best-known floating-point attack on naively sampled Gaussians, which reads the secret
  from the low-order bits of one Box–Muller sample: every coordinate is the normalised sum of two
  independent samples, each built in float64 from 53 uniformly random bits (the mitigation of
  Holohan & Braghin 2021, also used by Opacus's secure mode), then rounded to the working dtype.

What it does not protect against: timing side channels, an attacker with access to the machine
(memory, swap, core dumps), and floating-point effects of the model's own arithmetic. It also makes
the run irreproducible in its noise (everything else still reproduces).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch


def _uniform53(n: int) -> np.ndarray:
    """n floats uniform on (0, 1] from 53 random bits each."""
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return (raw.astype(np.float64) + 1.0) / float(1 << 53)


def _box_muller(n: int) -> np.ndarray:
    m = (n + 1) // 2
    u1, u2 = _uniform53(m), _uniform53(m)
    r = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])
    return z[:n]


def secure_randn(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    shape = tuple(shape) if not isinstance(shape, int) else (shape,)
    n = int(np.prod(shape)) if shape else 1
    z = (_box_muller(n) + _box_muller(n)) / math.sqrt(2.0)
    return torch.from_numpy(z.reshape(shape)).to(device=device, dtype=dtype)
