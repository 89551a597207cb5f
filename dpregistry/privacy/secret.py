"""Secret randomness: uniforms and Gaussians from AES-256-CTR keyed by the run's secret key.

The privacy noise and the sampling that amplification rests on (Poisson membership, uniformly
drawn batches) must be unpredictable to anyone who knows the recipe, the seed, the logs or a
checkpoint. They come from a 256-bit key (drawn from the operating system's entropy in
``secure`` mode, from ``DPREG_NOISE_KEY`` in ``keyed`` mode; see :mod:`dpregistry.rng`).
Each purpose and step has a stream of its own: its AES key is HMAC-SHA256(key, label), and the
counter starts at 0, so streams are independent and any stream can be regenerated from the key
alone (bitwise resume for whoever holds it).

Gaussians keep the defence against the floating-point attack on naively sampled Gaussians (the
secret read back from the low-order bits of one Box–Muller sample): each output is the normalised
sum of two Box–Muller samples from independent pairs, each pair built in float64 from two 53-bit
uniforms (Holohan & Braghin 2021; Opacus's secure mode sums samples for the same reason), then
rounded to the working dtype. Each output costs 16 bytes of keystream (two uniforms),
and one pair's two samples go to two different outputs.

The work is cut into fixed chunks of ``CHUNK`` outputs that each read their own range of blocks,
so the numbers do not depend on how many threads compute them. Both AES (``cryptography``) and
the float64 arithmetic (NumPy, torch) release the GIL, so chunks run on a thread pool.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
CHUNK = 1 << 16                     # outputs per chunk (its float64 work stays in cache)
_BLOCK = 16                         # AES block: two 64-bit words
_MANTISSA = np.uint64((1 << 53) - 1)
_TWO_PI = 2.0 * math.pi
_SQRT_HALF = math.sqrt(0.5)


def new_key() -> bytes:
    """A fresh 256-bit key from the operating system's entropy (never written anywhere)."""
    return os.urandom(KEY_BYTES)


def subkey(key: bytes, *label: object) -> bytes:
    """HMAC-SHA256(key, label): independent keys for independent uses of one secret."""
    msg = "\x1f".join(str(p) for p in label).encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


def fingerprint(key: bytes) -> str:
    """Identifies a key without revealing it (an HMAC under the key; stored in checkpoints)."""
    return subkey(key, "dpregistry-fingerprint").hex()[:32]


def _keystream(key: bytes, first_block: int, blocks: int, zeros: memoryview, out: bytearray) -> np.ndarray:
    """AES-256-CTR keystream blocks [first_block, first_block + blocks) as uint64 words."""
    enc = Cipher(algorithms.AES(key), modes.CTR(first_block.to_bytes(16, "big"))).encryptor()
    n = blocks * _BLOCK
    enc.update_into(zeros[:n], out)
    return np.frombuffer(out, dtype=np.uint64, count=2 * blocks)


def _uniform53(words: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Uniforms on (0, 1] from the top 53 bits of each word (never 0: log(0) is not a sample)."""
    np.right_shift(words, np.uint64(11), out=words)
    np.add(words, np.uint64(1), out=words)
    np.multiply(words, 2.0 ** -53, out=out)
    return out


class _Scratch:
    """Per-thread buffers for one chunk."""

    def __init__(self):
        self.zeros = memoryview(bytes(CHUNK * _BLOCK))
        self.raw = bytearray(CHUNK * _BLOCK + _BLOCK)  # update_into wants room for one more block
        self.u = np.empty(2 * CHUNK, dtype=np.float64)
        self.c = np.empty(CHUNK, dtype=np.float64)


def _gaussian_chunk(key: bytes, first_block: int, out: torch.Tensor, scratch: _Scratch) -> None:
    """Fill ``out`` (at most CHUNK outputs) from m pairs, m = len(out) rounded up to even, read from
    the 2m words of blocks [first_block, first_block + m): pair j takes its radius from word j and its
    angle from word m + j. Output j < m/2 sums the cosine samples of pairs j and j + m/2, output
    m/2 + j their sine samples, so no output sums the two samples of one pair."""
    n = out.numel()
    m = n + (n & 1)
    words = _keystream(key, first_block, m, scratch.zeros, scratch.raw)
    u = _uniform53(words, scratch.u[:2 * m])
    r, angle = u[:m], u[m:]
    np.log(r, out=r)
    np.multiply(r, -2.0, out=r)
    np.sqrt(r, out=r)
    rt, theta = torch.from_numpy(r), torch.from_numpy(angle)
    theta.mul_(_TWO_PI)
    cos = torch.from_numpy(scratch.c[:m])
    torch.cos(theta, out=cos)
    theta.sin_()                     # theta now holds the sines
    cos.mul_(rt)
    theta.mul_(rt)
    h = m // 2
    cos[:h].add_(cos[h:]).mul_(_SQRT_HALF)
    theta[:h].add_(theta[h:]).mul_(_SQRT_HALF)
    out[:h].copy_(cos[:h])
    out[h:].copy_(theta[:n - h])


class _Pool:
    """One thread pool for the process, with a scratch area per worker thread."""

    def __init__(self):
        self.workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, 8))
        self._pool: ThreadPoolExecutor | None = None
        self._scratch: dict[int, _Scratch] = {}

    def scratch(self) -> _Scratch:
        import threading

        ident = threading.get_ident()
        if ident not in self._scratch:
            self._scratch[ident] = _Scratch()
        return self._scratch[ident]

    def map(self, fn, items) -> None:
        items = list(items)
        if len(items) == 1 or self.workers == 1:
            for it in items:
                fn(it)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dpreg-secret")
        for f in [self._pool.submit(fn, it) for it in items]:
            f.result()


_POOL = _Pool()


class SecretStream:
    """The secret randomness of one purpose at one step; successive draws continue the stream.

    ``randn`` gives privacy noise, ``uniform`` gives sampling decisions, ``generator`` seeds a
    torch generator for secret draws that need torch's samplers (directions whose high-probability
    bound must not be predictable)."""

    def randn(self, shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
        raise NotImplementedError

    def uniform(self, n: int) -> torch.Tensor:
        """n float64 uniforms on (0, 1]."""
        raise NotImplementedError

    def generator(self) -> torch.Generator:
        raise NotImplementedError


class CipherStream(SecretStream):
    """AES-256-CTR under ``key``; block ``position`` is the next one not yet used."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError("a stream key has 256 bits")
        self._key = key
        self.position = 0

    def _take(self, blocks: int) -> int:
        first, self.position = self.position, self.position + blocks
        return first

    def randn(self, shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape)
        cpu_dtype = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        out = torch.empty(n, dtype=cpu_dtype)
        starts = range(0, n, CHUNK)
        firsts = []
        for s in starts:  # chunk blocks are laid out in order, whatever the thread count
            k = min(CHUNK, n - s)
            firsts.append(self._take(k + (k & 1)))
        key = self._key
        _POOL.map(lambda i: _gaussian_chunk(key, firsts[i], out[starts[i]:starts[i] + CHUNK], _POOL.scratch()),
                  range(len(firsts)))
        return out.view(shape).to(device=device, dtype=dtype)

    def uniform(self, n: int) -> torch.Tensor:
        blocks = (n + 1) // 2
        raw = bytearray(blocks * _BLOCK + _BLOCK)
        words = _keystream(self._key, self._take(blocks), blocks, memoryview(bytes(blocks * _BLOCK)), raw)
        return torch.from_numpy(_uniform53(words.copy(), np.empty(2 * blocks))[:n])

    def generator(self) -> torch.Generator:
        word = _keystream(self._key, self._take(1), 1, memoryview(bytes(_BLOCK)), bytearray(2 * _BLOCK))[0]
        return torch.Generator().manual_seed(int(word) & ((1 << 63) - 1))


class SeededStream(SecretStream):
    """Reproducible mode: torch's generator from a seed derived from the public recipe seed, so the
    noise can be regenerated by anyone with the recipe (research and tests only)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}

    def _gen(self, device) -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._gens[key]

    def randn(self, shape, dtype=torch.float32, device="cpu"):
        return torch.randn(shape, generator=self._gen(device), dtype=dtype, device=device)

    def uniform(self, n: int) -> torch.Tensor:
        return 1.0 - torch.rand(n, generator=self._gen("cpu"), dtype=torch.float64)  # on (0, 1]

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=self._gen("cpu"))))
