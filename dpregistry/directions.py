"""Seeded random directions, regenerated in place and never stored.

A :class:`Direction` is all a replica or a log needs to reproduce u: a public seed, a
distribution and the list of tensors it spans. u is drawn tensor by tensor, in fixed chunks, in
each tensor's own dtype, so that perturbing a parameter costs one chunk of scratch memory and the
same seed always gives the same u (DPZero §2.4, "seed trick").

Drawing Gaussians is the cost of a zeroth-order step's parameter sweeps. On a CPU, float32 chunks
of at least 2¹⁴ elements take them from Philox4x32-10 keyed per tensor, compiled with the
sweep's ``t += s·u`` into one vectorised, multi-threaded loop (:mod:`dpregistry.philox`); on a
CUDA GPU, float tensors take the same generator in the same layout from a Triton kernel, one
launch a sweep (a float32 tensor's u is the CPU's within 4·10⁻⁶ wherever the CPU's kernel
draws). Other chunks, those on other accelerators, and all chunks where the kernel does not
compile take torch's generator: every chunk has its own generator of the device, seeded from
(seed, tensor, chunk), and a CPU's chunks run on a thread pool (its generator is sequential). An
accelerator draws larger chunks: at 2²⁰ elements, OPT-6.7B's 6,400 chunks made a sweep on an
H200 cost 8.7 forward passes in per-chunk overhead. u therefore depends on whether the kernel
runs, and else on the device kind (its generator and chunk size); never on the number of
threads. Rademacher signs always come from the device's generator.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from . import philox
from .rng import derive

CHUNK = philox.LAYOUT  # elements per chunk (and per generator) on a CPU; fixed, so that regeneration is bit-identical
DEVICE_CHUNK = 1 << 24  # the same on an accelerator (one chunk of scratch: 64 MiB in fp32)
DISTRIBUTIONS = ("gaussian", "sphere", "rademacher")
_BITS = 32  # Rademacher signs per random int32 word (uniform on its whole range: 32 uniform bits)

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (threads, the pool)
_scratch = threading.local()  # one reused chunk buffer per thread and dtype: a sweep allocates no chunk


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def chunk_size(device: torch.device) -> int:
    return CHUNK if device.type == "cpu" else DEVICE_CHUNK


def _chunks(t: torch.Tensor):
    flat, k = t.view(-1), chunk_size(t.device)
    for start in range(0, flat.numel(), k):
        yield flat[start:start + k]


def _map(fn: Callable, tensors: list[torch.Tensor], pooled: bool = True, skip: frozenset = frozenset()) -> list:
    """[fn(tensor_index, chunk_index, chunk)] over every chunk of the tensors not in ``skip``, in
    order. On a CPU the chunks run on a thread pool (torch releases the GIL in its kernels) unless
    ``pooled`` is False (the compiled Philox kernel runs on every thread itself); on an
    accelerator, in order."""
    global _pool
    items = [(i, j, c) for i, t in enumerate(tensors) if i not in skip for j, c in enumerate(_chunks(t))]

    def run(item):
        with torch.no_grad():  # grad mode is per thread; u is never part of a graph
            return fn(*item)

    threads = torch.get_num_threads()
    if not pooled or threads <= 1 or len(items) <= 1 or any(t.device.type != "cpu" for t in tensors):
        return [run(it) for it in items]
    if _pool is None or _pool[0] != threads:
        _pool = (threads, ThreadPoolExecutor(threads, thread_name_prefix="dpreg-directions"))
    return list(_pool[1].map(run, items))


def _buffer(dtype: torch.dtype, device) -> torch.Tensor:
    """This thread's reused chunk of scratch (a sweep allocates no chunk of its own)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    if (dtype, device) not in buffers:
        buffers[dtype, device] = torch.empty(chunk_size(device) + _BITS, dtype=dtype, device=device)
    return buffers[dtype, device]


def _shifts(device) -> torch.Tensor:
    shifts = _scratch.__dict__.setdefault("shifts", {})
    if device not in shifts:
        shifts[device] = torch.arange(_BITS, dtype=torch.int32, device=device)
    return shifts[device]


@functools.lru_cache(maxsize=1 << 14)  # a step's three sweeps ask for the same few hundred keys
def _derive_seed(seed: int, tensor_index: int, chunk_index: int | None) -> int:
    if chunk_index is None:
        return derive("dpregistry-direction", seed, tensor_index)
    return derive("dpregistry-direction", seed, tensor_index, chunk_index)


@dataclass(frozen=True)
class Direction:
    """u = z (gaussian) or u = sqrt(d)·z/‖z‖ (sphere), z ~ N(0, I_d) drawn from ``seed``; or u with
    independent entries ±1 (rademacher).

    Rademacher u (an option; Gaussian is the default) has E[uuᵀ] = I and ‖u‖² = d exactly, as the
    sphere has, so the estimator's mean E[(uᵀa)u] = a, its second moment E[(uᵀa)²‖u‖²] = d‖a‖² and
    the finite-difference error (ℓ/2)·λ·d of DPZero spec §3.6 carry over; uᵀa is sub-Gaussian with
    variance proxy ‖a‖², so P(|uᵀa| ≥ C) ≤ 2·exp(−C²/(2‖a‖²)), tighter than the sphere's tail.
    What differs is the fourth moment: E[u_i⁴] = 1 (sphere 3d/(d+2), Gaussian 3), so
    E[(uᵀa)²uuᵀ] = 2aaᵀ + ‖a‖²I − 2·diag(a²). The privacy analysis does not involve u (it is public
    and the clipped, noised quantity is the scalar). A sign costs 1/32 of a generator call, so a
    parameter sweep is several times cheaper than with Gaussian draws.
    """

    seed: int
    distribution: str = "gaussian"

    def _seed(self, tensor_index: int, chunk_index: int | None = None) -> int:
        """A chunk's generator seed; Philox takes one key per tensor (None) and counts its elements."""
        return _derive_seed(self.seed, tensor_index, chunk_index)

    def _philox(self, chunk: torch.Tensor) -> bool:
        """Whether the chunk's z comes from the compiled Philox kernel (Gaussian and sphere
        directions; see ``philox.takes``)."""
        return self.distribution != "rademacher" and philox.takes(chunk)

    def _philox_add_(self, tensor_index: int, chunk_index: int, chunk: torch.Tensor, scale: float) -> None:
        """chunk += scale·z from the Philox kernel, under the tensor's key, counted from the chunk's first element."""
        philox.add_(chunk, self._seed(tensor_index), scale, chunk_index * chunk_size(chunk.device))

    def _pooled(self, tensors: list[torch.Tensor]) -> bool:
        """Chunks go to the thread pool unless the Philox kernel draws any (it uses every thread)."""
        return not any(self._philox(c) for t in tensors for c in _chunks(t))

    def _draw(self, tensor_index: int, chunk_index: int, like: torch.Tensor) -> torch.Tensor:
        """This chunk's z, in a scratch buffer of the calling thread (valid until its next draw)."""
        out = _buffer(like.dtype, like.device)[:like.numel()].view(like.shape)
        if self._philox(like):
            self._philox_add_(tensor_index, chunk_index, out.zero_(), 1.0)
            return out
        g = torch.Generator(device=like.device)
        g.manual_seed(self._seed(tensor_index, chunk_index))
        if self.distribution != "rademacher":
            return out.normal_(generator=g)
        # 32 signs per uniform int32 word: entry 32·w + k is −1 where bit 31 − k of word w is set,
        # +1 where it is not (shifted to the sign bit, then spread by an arithmetic shift: 0 or −1, | 1)
        words = torch.empty(-(-like.numel() // _BITS), 1, dtype=torch.int32, device=like.device)
        words.random_(-(1 << 31), 1 << 31, generator=g)
        signs = _buffer(torch.int32, like.device)[:words.numel() * _BITS].view(-1, _BITS)
        torch.bitwise_left_shift(words, _shifts(like.device), out=signs).bitwise_right_shift_(_BITS - 1)
        return out.copy_(signs.bitwise_or_(1).view(-1)[:like.numel()].view(like.shape))

    def _scale(self, tensors: list[torch.Tensor]) -> float:
        if self.distribution in ("gaussian", "rademacher"):
            return 1.0
        if self.distribution != "sphere":
            raise ValueError(f"unknown direction distribution {self.distribution!r}")
        # Sphere: one extra regeneration pass for ‖z‖ (DPZero spec §6, note on the sphere).
        sq = _map(lambda i, j, c: float(self._draw(i, j, c).double().pow(2).sum()), tensors, self._pooled(tensors))
        return math.sqrt(sum(t.numel() for t in tensors) / math.fsum(sq))

    def add_(self, tensors: Iterable[torch.Tensor], scale: float) -> None:
        """t += scale·u, chunk by chunk, in place."""
        tensors = list(tensors)
        s = scale * self._scale(tensors)

        def sweep(i, j, c):
            if self._philox(c):  # u is drawn inside the loop that adds it: never written to memory
                self._philox_add_(i, j, c, s)
            else:
                c.add_(self._draw(i, j, c), alpha=s)

        whole = [i for i, t in enumerate(tensors) if self.distribution != "rademacher" and philox.takes_whole(t)]
        if whole:  # a CUDA GPU's kernel: one launch for all, the same z as chunk by chunk
            philox.add_tensors_([tensors[i] for i in whole], [self._seed(i) for i in whole], s)
        _map(sweep, tensors, self._pooled(tensors), skip=frozenset(whole))

    def dense(self, tensors: Iterable[torch.Tensor], dtype=None) -> list[torch.Tensor]:
        """Materialise u in the shapes of ``tensors`` (costs d memory: tests and dense lifts only)."""
        tensors = list(tensors)
        s = self._scale(tensors)
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        _map(lambda i, j, c: c.copy_(self._draw(i, j, c)).mul_(s), out, self._pooled(out))
        return [o.to(dtype) if dtype is not None else o for o in out]

    def dot(self, tensors: Iterable[torch.Tensor], others: Mapping[int, torch.Tensor] | list) -> float:
        """⟨u, v⟩ for v given in the shapes of ``tensors`` (fp64 accumulation)."""
        tensors = list(tensors)
        s = self._scale(tensors)
        flat = [v.contiguous().view(-1) for v in others]

        def term(i, j, c):
            k = chunk_size(c.device)
            v = flat[i][j * k:j * k + c.numel()]
            return float((self._draw(i, j, c).double() * v.double()).sum())

        return math.fsum(_map(term, tensors, self._pooled(tensors))) * s
