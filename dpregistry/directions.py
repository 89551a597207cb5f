"""Seeded random directions, regenerated in place and never stored.

A :class:`Direction` is all a replica or a log needs to reproduce u: a public seed, a
distribution and the list of tensors it spans. u is drawn tensor by tensor, in fixed chunks, in
each tensor's own dtype, so that perturbing a parameter costs one chunk of scratch memory and the
same seed always gives the same u (DPZero §2.4, "seed trick").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

CHUNK = 1 << 20  # elements drawn per call; fixed, so that regeneration is bit-identical
DISTRIBUTIONS = ("gaussian", "sphere")


def _chunks(t: torch.Tensor):
    flat = t.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start:start + CHUNK]


@dataclass(frozen=True)
class Direction:
    """u = z (gaussian) or u = sqrt(d)·z/‖z‖ (sphere), z ~ N(0, I_d) drawn from ``seed``."""

    seed: int
    distribution: str = "gaussian"

    def _generator(self, device) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g

    def _scale(self, tensors: list[torch.Tensor]) -> float:
        if self.distribution == "gaussian":
            return 1.0
        if self.distribution != "sphere":
            raise ValueError(f"unknown direction distribution {self.distribution!r}")
        # Sphere: one extra regeneration pass for ‖z‖ (DPZero spec §6, note on the sphere).
        sq, d = 0.0, 0
        for z in self._draws(tensors):
            sq += float(z.double().pow(2).sum())
            d += z.numel()
        return math.sqrt(d / sq)

    def _draws(self, tensors: list[torch.Tensor]):
        g = None
        for t in tensors:
            if g is None:
                g = self._generator(t.device)
            for chunk in _chunks(t):
                yield torch.randn(chunk.shape, generator=g, device=t.device, dtype=t.dtype)

    @torch.no_grad()
    def add_(self, tensors: Iterable[torch.Tensor], scale: float) -> None:
        """t += scale·u, chunk by chunk, in place."""
        tensors = list(tensors)
        s = scale * self._scale(tensors)
        draws = self._draws(tensors)
        for t in tensors:
            for chunk in _chunks(t):
                chunk.add_(next(draws), alpha=s)

    @torch.no_grad()
    def dense(self, tensors: Iterable[torch.Tensor], dtype=None) -> list[torch.Tensor]:
        """Materialise u in the shapes of ``tensors`` (costs d memory: tests and dense lifts only)."""
        tensors = list(tensors)
        s = self._scale(tensors)
        out = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in tensors]
        draws = self._draws(tensors)
        for o in out:
            for chunk in _chunks(o):
                chunk.copy_(next(draws)).mul_(s)
        return out

    @torch.no_grad()
    def dot(self, tensors: Iterable[torch.Tensor], others: Mapping[int, torch.Tensor] | list) -> float:
        """⟨u, v⟩ for v given in the shapes of ``tensors`` (fp64 accumulation)."""
        tensors = list(tensors)
        s = self._scale(tensors)
        total = 0.0
        draws = self._draws(tensors)
        for t, v in zip(tensors, others):
            for vc in _chunks(v.contiguous()):
                total += float((next(draws).double() * vc.double()).sum())
        return total * s
