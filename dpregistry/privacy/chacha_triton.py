"""The secret-noise chunk of :mod:`dpregistry.privacy.chacha` as one Triton kernel, for CUDA GPUs.

``torch.compile`` fuses the chunk's ops, but Inductor holds ChaCha20's 32-bit words in int64
(as the torch ops do), which a GPU emulates: on an H100 a chunk of 4M Gaussians took 0.9 ms and
RoBERTa-large's 366M took 0.08 s, a third of a non-private step. Here the words are uint32, so
each round is native 32-bit arithmetic: 88 chunks (366M) take 9.7 ms on an H100. The output is the same array: the same blocks, the same
64-bit words, the same float64 formula in the same order of operations. With the multiply-adds
left unfused (``enable_fp_fusion=False``) and CUDA's libdevice for ``log`` and ``cos``, as the
uncompiled ops use, the numbers are meant to match those ops bit for bit (checked on a GPU by
``benchmarks/gpu_checks.py``).

A program computes ``BLOCK`` output pairs j: outputs j and h + j of a chunk of m (h = m/2) read
the 64-bit words j, h + j (radii) and m + j, m + h + j (angles), four runs of ``BLOCK`` words,
each ``BLOCK/8`` whole ChaCha blocks: no block is computed twice.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

BLOCK = 1024  # output pairs a program (a multiple of 8), on 4 warps: the fastest of six shapes on an H100
WARPS = 4     # (benchmarks/gpu_kernel_shapes.py: 9.7 ms for RoBERTa-large's 366M draws; 256 on 4 warps 19.5)
_ANGLE = struct.unpack("<q", struct.pack("<d", math.pi * 2.0 ** -63))[0]  # its float64 bits (a float literal
                                                                          # in a kernel is float32)


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    """RFC 8439 §2.1 on uint32 words (``chacha._quarter`` in torch's masked int64)."""
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _words(key_ptr, block, BLOCK: tl.constexpr):
    """The 64-bit words 8·block[0] … of ChaCha20 blocks ``block`` (BLOCK/8 consecutive counters),
    as BLOCK uint64 in keystream order."""
    s0 = tl.full([BLOCK // 8], 0x61707865, tl.uint32)
    s1 = tl.full([BLOCK // 8], 0x3320646E, tl.uint32)
    s2 = tl.full([BLOCK // 8], 0x79622D32, tl.uint32)
    s3 = tl.full([BLOCK // 8], 0x6B206574, tl.uint32)
    s4 = tl.load(key_ptr + 0).to(tl.uint32) + s0 * 0
    s5 = tl.load(key_ptr + 1).to(tl.uint32) + s0 * 0
    s6 = tl.load(key_ptr + 2).to(tl.uint32) + s0 * 0
    s7 = tl.load(key_ptr + 3).to(tl.uint32) + s0 * 0
    s8 = tl.load(key_ptr + 4).to(tl.uint32) + s0 * 0
    s9 = tl.load(key_ptr + 5).to(tl.uint32) + s0 * 0
    s10 = tl.load(key_ptr + 6).to(tl.uint32) + s0 * 0
    s11 = tl.load(key_ptr + 7).to(tl.uint32) + s0 * 0
    s12 = (block & 0xFFFFFFFF).to(tl.uint32)
    s13 = (block >> 32).to(tl.uint32)
    s14 = s0 * 0
    s15 = s0 * 0
    x0, x1, x2, x3, x4, x5, x6, x7 = s0, s1, s2, s3, s4, s5, s6, s7
    x8, x9, x10, x11, x12, x13, x14, x15 = s8, s9, s10, s11, s12, s13, s14, s15
    for _ in tl.static_range(10):  # a column round and a diagonal round
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    w0 = (x0 + s0).to(tl.uint64) | ((x1 + s1).to(tl.uint64) << 32)
    w1 = (x2 + s2).to(tl.uint64) | ((x3 + s3).to(tl.uint64) << 32)
    w2 = (x4 + s4).to(tl.uint64) | ((x5 + s5).to(tl.uint64) << 32)
    w3 = (x6 + s6).to(tl.uint64) | ((x7 + s7).to(tl.uint64) << 32)
    w4 = (x8 + s8).to(tl.uint64) | ((x9 + s9).to(tl.uint64) << 32)
    w5 = (x10 + s10).to(tl.uint64) | ((x11 + s11).to(tl.uint64) << 32)
    w6 = (x12 + s12).to(tl.uint64) | ((x13 + s13).to(tl.uint64) << 32)
    w7 = (x14 + s14).to(tl.uint64) | ((x15 + s15).to(tl.uint64) << 32)
    # word 8·i + k of the run is w_k[i]: interleaving pairs twice, then the halves
    even = tl.interleave(tl.interleave(w0, w4), tl.interleave(w2, w6))
    odd = tl.interleave(tl.interleave(w1, w5), tl.interleave(w3, w7))
    return tl.interleave(even, odd)


@triton.jit
def _pair(a, b, angle):
    """One pair's two samples, ρ·cos θ and ρ·sin θ (``chacha.gaussians_from_words``)."""
    one = ((a >> 12) | 0x3FF0000000000000).to(tl.float64, bitcast=True)      # 1.f in [1, 2)
    rho = tl.sqrt(-tl.log(2.0 - one))
    signed = b.to(tl.int64, bitcast=True)
    cos = tl.cos(signed.to(tl.float64) * angle)
    sin_bits = tl.sqrt(tl.abs(1.0 - cos * cos)).to(tl.uint64, bitcast=True) | (b & 0x8000000000000000)
    return cos * rho, sin_bits.to(tl.float64, bitcast=True) * rho


@triton.jit
def _chunk(key_ptr, start_ptr, out_ptr, m, ANGLE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    h = m // 2
    j0 = tl.program_id(0) * BLOCK
    first = tl.load(start_ptr)                     # the chunk's first block
    angle = tl.full([], ANGLE_BITS, tl.int64).to(tl.float64, bitcast=True)
    radius1 = _words(key_ptr, first + j0 // 8 + tl.arange(0, BLOCK // 8), BLOCK)
    radius2 = _words(key_ptr, first + (h + j0) // 8 + tl.arange(0, BLOCK // 8), BLOCK)
    angle1 = _words(key_ptr, first + (m + j0) // 8 + tl.arange(0, BLOCK // 8), BLOCK)
    angle2 = _words(key_ptr, first + (m + h + j0) // 8 + tl.arange(0, BLOCK // 8), BLOCK)
    cos1, sin1 = _pair(radius1, angle1, angle)
    cos2, sin2 = _pair(radius2, angle2, angle)
    j = j0 + tl.arange(0, BLOCK)
    live = j < h
    tl.store(out_ptr + j, cos1 + cos2, mask=live)
    tl.store(out_ptr + h + j, sin1 + sin2, mask=live)


def gaussian_chunk(key: torch.Tensor, start: torch.Tensor, m: int) -> torch.Tensor:
    """m float64 Gaussians (m a multiple of 16) from blocks [start, start + m/4) under ``key``
    (eight words in an int64 tensor; ``start`` a 0-d int64 tensor, both on the output's device)."""
    if m % 16:
        raise ValueError(f"a chunk is a multiple of 16 outputs, not {m}")
    out = torch.empty(m, dtype=torch.float64, device=key.device)
    _chunk[(triton.cdiv(m // 2, BLOCK),)](key, start, out, m, ANGLE_BITS=_ANGLE, BLOCK=BLOCK,
                                          num_warps=WARPS, enable_fp_fusion=False)
    return out
