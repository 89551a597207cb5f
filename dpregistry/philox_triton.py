"""The Philox sweep ``t += s·u`` as one Triton kernel, for CUDA GPUs.

On a GPU, torch's generator drew u into a scratch chunk that the sweep then read back, chunk by
chunk: on an H100, an OPT-6.7B fp16 sweep cost 1.18 forward passes. Compiling the CPU's kernel
(:mod:`dpregistry.philox`) for CUDA ran 5 × slower still: Inductor writes Philox's 32 × 32-bit
products as int64 arithmetic, which a GPU emulates. Triton has the instructions themselves
(``umulhi`` and a wrapping 32-bit multiply), so here each program runs Philox4x32-10 on a block of
counters, turns each counter's four words into four Gaussians, and adds them to the four
elements that the CPU kernel's layout gives them. The sweep reads and writes each element once,
and a sweep of all the parameters of one dtype is one launch over a table of their layout units
(OPT-6.7B has 516 tensors: one launch each would make the sweep wait on the host).

The layout is the CPU's (see :mod:`dpregistry.philox`), over the CPU's chunks of ``LAYOUT``
elements counted from the start of the tensor. A float32 tensor therefore gets the same u on
both devices, within the error of the GPU's sine and cosine units (3.2·10⁻⁶ at most over 20M
draws on an H100). A float16 or bfloat16 tensor is updated in float32 and rounded once.

On an H100 an OPT-6.7B fp16 sweep takes 18.5–19.6 ms: 1.6 × one read and write of its 13.3 GB
(11.8 ms), against 39 ms with torch's generator; the rest is Philox's and Box–Muller's arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .philox import LAYOUT, key_words

BLOCK = 1024      # counters a program (4 · BLOCK elements), on 8 warps: the fastest of six shapes on an H100
WARPS = 8         # (benchmarks/gpu_kernel_shapes.py: 18.5 ms an OPT-6.7B fp16 sweep; 1024 on 4 warps 24.7)
FAST = not triton.knobs.runtime.interpret  # the interpreter has no libdevice


@triton.jit
def _rounds(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011): ten rounds, the key bumped by the Weyl constants between them."""
    for _ in tl.static_range(10):
        a, b = c0, c2
        c0 = tl.umulhi(b, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a, 0xD2511F53) ^ c3 ^ k1
        c1 = b * 0xCD9E8D57
        c3 = a * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _box_muller(a, b, FAST: tl.constexpr):
    """ρ·cos θ and ρ·sin θ, ρ = √(−2 ln v), v = ((a >> 8) + 1)/2²⁴, θ = 2π·(b >> 8)/2²⁴, in float32.
    FAST: the GPU's sine and cosine units (PTX's approximate sin and cos, absolute error about
    2⁻²⁰), in place of libdevice's reduced polynomials, which made up three fifths of the kernel's
    instructions (ptxas for sm_90: 498 a counter against 201). The logarithm stays libdevice's: an
    approximate one near v = 1 could make −2 ln v negative."""
    v = ((a >> 8) + 1).to(tl.float32) * 5.9604644775390625e-08          # 2⁻²⁴
    rho = tl.sqrt(-2.0 * tl.log(v))
    theta = (b >> 8).to(tl.float32) * 3.7450702829239286e-07              # 2π·2⁻²⁴
    if FAST:
        return rho * libdevice.fast_cosf(theta), rho * libdevice.fast_sinf(theta)
    return rho * tl.cos(theta), rho * tl.sin(theta)


@triton.jit
def _add(ptr, x, scale, mask):
    p = tl.load(ptr, mask=mask)
    tl.store(ptr, (p.to(tl.float32) + x * scale).to(p.dtype), mask=mask)


@triton.jit
def _sweep(units_ptr, keys_ptr, scale, DTYPE: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr):
    """Program (i, b) adds to layout unit i of the table: its address, size, first counter and
    tensor; counters b·BLOCK … of the unit's q; counter r feeds elements r, q + r, 2q + r, 3q + r."""
    row = units_ptr + 4 * tl.program_id(0)
    size = tl.load(row + 1)
    q = (size + 3) // 4
    r0 = tl.program_id(1) * BLOCK
    if r0 < q:
        p = tl.load(row).to(tl.pointer_type(DTYPE))
        c = tl.load(row + 2) + r0 + tl.arange(0, BLOCK)
        tensor = tl.load(row + 3)
        zero = tl.zeros([BLOCK], dtype=tl.uint32)
        w0, w1, w2, w3 = _rounds((c & 0xFFFFFFFF).to(tl.uint32), (c >> 32).to(tl.uint32), zero, zero,
                                 tl.load(keys_ptr + 2 * tensor).to(tl.uint32),
                                 tl.load(keys_ptr + 2 * tensor + 1).to(tl.uint32))
        z0, z1 = _box_muller(w0, w1, FAST)
        z2, z3 = _box_muller(w2, w3, FAST)
        r = r0 + tl.arange(0, BLOCK)
        live = r < q
        _add(p + r, z0, scale, live)
        _add(p + q + r, z1, scale, live & (q + r < size))
        _add(p + 2 * q + r, z2, scale, live & (2 * q + r < size))
        _add(p + 3 * q + r, z3, scale, live & (3 * q + r < size))


DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_tables: dict[tuple, torch.Tensor] = {}  # the unit table of a list of tensors (the parameters: built once)


def _units(tensors: list, starts: list) -> torch.Tensor:
    """Rows (address, size, first counter, tensor) of every layout unit, on the tensors' device."""
    ident = tuple((t.data_ptr(), t.numel(), s) for t, s in zip(tensors, starts))
    if ident not in _tables:
        rows = [(t.data_ptr() + first * t.element_size(), min(LAYOUT, t.numel() - first), (s + first) // 4, i)
                for i, (t, s) in enumerate(zip(tensors, starts)) for first in range(0, t.numel(), LAYOUT)]
        if len(_tables) > 64:  # a sweep's list is the same every step; chunks of dense draws vary
            _tables.clear()
        _tables[ident] = torch.tensor(rows, dtype=torch.int64).to(tensors[0].device)
    return _tables[ident]


def add_(tensors: list, seeds: list, scale: float, starts: list | None = None) -> None:
    """t += scale·u for contiguous CUDA tensors of one dtype, in one launch: tensor i keyed by
    seeds[i] and starting at element starts[i] (a multiple of LAYOUT; 0 by default) of the
    tensor that the key belongs to."""
    starts = starts or [0] * len(tensors)
    if any(s % LAYOUT for s in starts) or len({t.dtype for t in tensors}) > 1:
        raise ValueError("one dtype a call, each tensor from a multiple of LAYOUT elements")
    if not any(t.numel() for t in tensors):  # no layout unit: nothing to launch
        return
    units = _units(tensors, starts)  # an empty tensor has no row; its key goes unread
    keys = torch.tensor([key_words(s) for s in seeds], dtype=torch.int64)
    if units.is_cuda:  # from pinned memory: the copy does not wait for the work queued before it
        keys = keys.pin_memory().to(units.device, non_blocking=True)
    grid = (units.shape[0], triton.cdiv(LAYOUT // 4, BLOCK))
    _sweep[grid](units, keys, scale, DTYPE=DTYPES[tensors[0].dtype], BLOCK=BLOCK, FAST=FAST, num_warps=WARPS)
