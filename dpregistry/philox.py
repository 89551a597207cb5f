"""Gaussian directions from Philox4x32-10, drawn and added to the parameters in one compiled loop.

A zeroth-order step sweeps the parameters three times (θ + λu, θ − λu, the update), and each
sweep regenerates d Gaussians (:mod:`dpregistry.directions`). With torch's CPU generator
(mt19937, sequential, 2.3–2.6 ns a draw) and u written to a scratch chunk and read back, a sweep
cost 0.19 of a forward pass on OPT-125m. Here u comes from a counter-based generator,
Philox4x32-10 (Salmon, Moraes, Dror & Shaw, SC 2011; the generator of cuRAND and JAX), and
``torch.compile`` fuses its ten rounds, the Box–Muller transform and ``p += s·u`` into one
vectorised, multi-threaded loop: no u is ever written to memory, and each element depends only on
its key, its chunk and its place in the chunk, never on the number of threads. Compiled by
Inductor for CPUs only: the rounds multiply 32-bit words into 64-bit products, which Inductor
writes as int64 arithmetic that a GPU emulates (on an H100, 22.7 ps an element against torch's own
generator's 4.4). CUDA GPUs run the same generator and layout as a Triton kernel instead
(:mod:`dpregistry.philox_triton`), one launch a sweep; other accelerators keep torch's generator
(:mod:`dpregistry.directions`).

A chunk of n elements that starts at element ``start`` of its tensor (keyed per tensor) reads the
q = ⌈n/4⌉ counters start/4 … start/4 + q − 1, so no two chunks of a tensor share one; counter c's
words (w0, w1, w2, w3) give, as pairs (w0, w1) and (w2, w3), the chunk's elements c, q + c,
2q + c and 3q + c (four contiguous blocks: the compiled loop stores them vectorised; interleaved,
it ran 1.4 × slower), those ≥ n dropped. A pair (a, b) gives ρ·cos θ and ρ·sin θ with
ρ = √(−2 ln v), v = ((a >> 8) + 1)/2²⁴ ∈ (0, 1], and θ = 2π·(b >> 8)/2²⁴, in float32, as torch's
own CPU sampler does (so |u_i| ≤ √(2 ln 2²⁴) = 5.77, a truncation of probability 2·10⁻⁹ a draw).
On a CPU, chunks below MIN_CHUNK elements, and of another dtype, take torch's generator
(:mod:`dpregistry.directions`); on a CUDA GPU the kernel takes float32, float16 and bfloat16
tensors of any size (u in float32, the sum rounded once to the tensor's dtype).

The compiled loop and the same ops run uncompiled round ``log``/``cos`` differently in the last
bit, so a process settles once, per device type, which it uses: where compiling fails (no C++
compiler, no Triton), a warning says so and :mod:`dpregistry.directions` draws with the
device's torch generator, as before.
"""

from __future__ import annotations

import math
import threading
import warnings

import torch

from .progress import say

_MASK = 0xFFFFFFFF
LAYOUT = 1 << 20  # a CPU chunk (directions.CHUNK): CUDA's whole-tensor kernel lays u out over these
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # its Weyl key increments
ROUNDS = 10


def philox(c: list[torch.Tensor], k0: torch.Tensor, k1: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 on four counter words (int64 tensors holding uint32 values) under key (k0, k1)."""
    c0, c1, c2, c3 = c
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = c0 * _M0, c2 * _M1  # < 2⁶⁴: the int64 product wraps, its 64 bits are exact
        c0, c1, c2, c3 = ((p1 >> 32) & _MASK) ^ c1 ^ k0, p1 & _MASK, ((p0 >> 32) & _MASK) ^ c3 ^ k1, p0 & _MASK
    return [c0, c1, c2, c3]


def _box_muller(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v = ((a >> 8) + 1).to(torch.float32) * 2.0 ** -24
    rho = torch.sqrt(-2.0 * torch.log(v))
    theta = (b >> 8).to(torch.float32) * (2.0 * math.pi * 2.0 ** -24)
    return rho * torch.cos(theta), rho * torch.sin(theta)


def gaussians(n: int, k0: torch.Tensor, k1: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The n float32 Gaussians of a chunk from element ``start`` (a multiple of 4; a 0-d int64
    tensor) of its tensor, in the layout above."""
    c = (start >> 2) + torch.arange(-(-n // 4), dtype=torch.int64, device=start.device)
    zero = torch.zeros_like(c)
    w0, w1, w2, w3 = philox([c & _MASK, c >> 32, zero, zero], k0, k1)
    return torch.cat([*_box_muller(w0, w1), *_box_muller(w2, w3)])[:n]


def _add_(p: torch.Tensor, key: torch.Tensor, scale: torch.Tensor) -> None:
    """p += scale·u for a flat float32 chunk p; ``key`` holds (k0, k1, the chunk's first element)."""
    p.add_(gaussians(p.numel(), key[0], key[1], key[2]) * scale.to(torch.float32))


# Dynamo compiles a kernel per dtype and per torch thread count (a guard), and by default fails
# (fullgraph) past 8: the kernel takes float32 chunks only, and a call that hits the limit is
# retried with room for one kernel per thread count up to _KERNELS. And chunks of at least
# MIN_CHUNK elements, since a call costs about 40 µs (guards, a parallel region) and torch's
# generator draws a short chunk sooner.
MIN_CHUNK = 1 << 14
_KERNELS = 64
_LIMIT_HIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())  # raised before the kernel runs


def _room():
    """Within the block, dynamo may keep _KERNELS kernels of a function (one per thread count)."""
    return torch._dynamo.config.patch(recompile_limit=_KERNELS)


class _CompiledLoop:
    """The CPU's kernel: ``_add_`` compiled by Inductor, one float32 chunk a call."""

    whole = False  # a chunk a call: Direction cuts tensors into CPU chunks for it

    def __init__(self, device: torch.device):
        self._fn = torch.compile(_add_, dynamic=True, fullgraph=True)
        self(torch.zeros(MIN_CHUNK, device=device), 0, 1.0, 0)  # compiles, or raises

    def takes(self, chunk: torch.Tensor) -> bool:
        return chunk.dtype == torch.float32 and chunk.numel() >= MIN_CHUNK

    def __call__(self, chunk: torch.Tensor, seed: int, scale: float, start: int) -> None:
        args = chunk.view(-1), _key(seed, start, chunk.device), torch.tensor(scale, dtype=torch.float64)
        with torch.no_grad():  # grad mode is one of the compiled kernel's guards
            try:
                self._fn(*args)
            except _LIMIT_HIT:  # a new thread count past dynamo's default number of kernels
                with _room():
                    self._fn(*args)


class _TritonSweep:
    """A CUDA GPU's kernel (:mod:`dpregistry.philox_triton`): float tensors of any size, whole."""

    whole = True

    def __init__(self, device: torch.device):
        from . import philox_triton  # imports triton: CUDA processes only

        self._triton = philox_triton
        self(torch.zeros(8, device=device), 0, 1.0, 0)  # builds, or raises

    def takes(self, chunk: torch.Tensor) -> bool:
        return chunk.dtype in self._triton.DTYPES

    def __call__(self, chunk: torch.Tensor, seed: int, scale: float, start: int) -> None:
        self._triton.add_([chunk.view(-1)], [seed], scale, [start])

    def add_tensors_(self, tensors: list[torch.Tensor], seeds: list[int], scale: float) -> None:
        self._triton.add_([t.view(-1) for t in tensors], seeds, scale)


_KINDS = {"cpu": _CompiledLoop, "cuda": _TritonSweep}
_kernels: dict[str, object] = {}  # device type -> its kernel, or None where it failed to build (settled)
_lock = threading.Lock()


def _kernel(device: torch.device):
    """The kernel for ``device``'s type, or None; settled by the first call of a process."""
    kind = device.type
    if kind not in _KINDS or (kind == "cpu" and getattr(torch._dynamo.config, "disable", False)):
        return None  # TORCH_COMPILE_DISABLE: "compiled" code would run op by op, 50 × slower
    if kind in _kernels:  # settled: every chunk asks, so no lock once the answer is in
        return _kernels[kind]
    with _lock:
        if kind not in _kernels:
            say(f"random directions: compiling the Gaussian kernel for {kind}, once per process (a few seconds)")
            try:
                _kernels[kind] = _KINDS[kind](device)
            except Exception as e:  # no C++ compiler, no Inductor backend, no Triton
                warnings.warn(f"random directions: compiling the Philox kernel failed ({type(e).__name__}); "
                              f"Gaussian directions come from torch's generator instead (slower)",
                              RuntimeWarning, stacklevel=3)
                _kernels[kind] = None
        return _kernels[kind]


def key_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as Philox's two 32-bit key words."""
    return seed & _MASK, (seed >> 32) & _MASK


def _key(seed: int, start: int, device) -> torch.Tensor:
    """The seed's key words and the chunk's first element (a tensor: one compiled kernel serves
    every key and chunk)."""
    return torch.tensor([*key_words(seed), start], dtype=torch.int64, device=device)


def takes(chunk: torch.Tensor) -> bool:
    """Whether this chunk's Gaussians come from the kernel: a float32 chunk of at least MIN_CHUNK
    elements on a CPU where torch.compile works, or a float chunk on a CUDA GPU where Triton does."""
    kernel = _kernel(chunk.device)
    return kernel is not None and kernel.takes(chunk)


def takes_whole(t: torch.Tensor) -> bool:
    """Whether the kernel sweeps ``t`` whole, with no chunk of scratch (a CUDA GPU's: ``add_tensors_``)."""
    return t.is_contiguous() and takes(t) and _kernel(t.device).whole


def add_tensors_(tensors: list[torch.Tensor], seeds: list[int], scale: float) -> None:
    """t += scale·u for tensors that the kernel ``takes_whole``, each keyed by its seed: one
    launch a dtype, the same u as chunk by chunk."""
    for dtype in {t.dtype for t in tensors}:
        group = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        _kernel(tensors[group[0]].device).add_tensors_([tensors[i] for i in group], [seeds[i] for i in group], scale)


def add_(chunk: torch.Tensor, seed: int, scale: float, start: int = 0) -> None:
    """chunk += scale·u in place, u the Gaussians of ``seed`` from element ``start`` of the tensor
    the chunk is cut from (a multiple of 4; a contiguous chunk that the kernel ``takes``)."""
    if start % 4 or not takes(chunk):
        raise ValueError(f"not a chunk for the Philox kernel: {chunk.numel()} {chunk.dtype} elements from {start}")
    _kernel(chunk.device)(chunk, seed, scale, start)
