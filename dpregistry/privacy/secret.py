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
sum of two Box–Muller samples from independent pairs, each pair built in float64 from a 52-bit
radius uniform and a 64-bit angle (Holohan & Braghin 2021; Opacus's secure mode sums samples for
the same reason), then rounded to the working dtype. Each output costs 16 bytes of keystream (one
pair's two words), and one pair's two samples go to two different outputs.

The work is cut into fixed chunks of ``CHUNK`` outputs that each read their own range of blocks,
so the numbers do not depend on how many threads compute them. Both AES (``cryptography``) and
the float64 arithmetic (NumPy, torch) release the GIL, so chunks run on a thread pool.

Tensors on another device (a GPU) get their noise drawn there, by the same formula from a
ChaCha20 keystream under HMAC(stream key, "device") (:mod:`dpregistry.privacy.chacha`): copying
AES noise from the host made the noise most of a GPU step.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from . import chacha

KEY_BYTES = 32
CHUNK = 1 << 17                     # outputs per chunk: enough to make the per-call overhead small
_BLOCK = 16                         # AES block: two 64-bit words


def new_key() -> bytes:
    """A fresh 256-bit key from the operating system's entropy (never written anywhere)."""
    return os.urandom(KEY_BYTES)


def label_bytes(*parts: object) -> bytes:
    """The parts joined by the unit separator, which no part may hold: otherwise the parts "a", "b"
    and the one part "a", separator, "b" would name one stream."""
    texts = [str(p) for p in parts]
    if any("\x1f" in t for t in texts):
        raise ValueError(f"a stream label part holds the separator \\x1f: {texts!r}")
    return "\x1f".join(texts).encode()


def subkey(key: bytes, *label: object) -> bytes:
    """HMAC-SHA256(key, label): independent keys for independent uses of one secret."""
    return hmac.new(key, label_bytes(*label), hashlib.sha256).digest()


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


_HALF = CHUNK // 2  # torch runs a unary op of at most 32768 elements inline, not on its own threads
# torch's CPU generator state (CPUGeneratorImplState): seed, left, seeded, next, then MT19937's 624
# words, each in 64 bits, from byte 24
_MT_STATE_BYTES, _MT_OFFSET, _MT_WORDS = 5056, 24, 624
_ONE = np.uint64(0x3FF0000000000000)  # the sign and exponent bits of 1.0
_SIGN = np.uint64(1 << 63)


class _Scratch:
    """Per-thread buffers for one chunk."""

    def __init__(self):
        self.zeros = memoryview(bytes(CHUNK * _BLOCK))
        self.raw = bytearray(CHUNK * _BLOCK + _BLOCK)  # update_into wants room for one more block
        self.f = np.empty((3, CHUNK), dtype=np.float64)


def _gaussian_chunk(key: bytes, first_block: int, n: int, scratch: _Scratch) -> np.ndarray:
    """n ≤ CHUNK float64 outputs (a view of ``scratch``) from m pairs, m = n rounded up to even,
    read from the 2m 64-bit words of blocks [first_block, first_block + m).

    Pair j has radius word a = word j and angle word b = word m + j: u = 2 - 1.f on (0, 1], where f
    is the top 52 bits of a (the bits of a double in [1, 2), so no conversion), and θ = π·b/2⁶³ on
    [-π, π) for b read as signed. Its samples are ρ·cos θ and ρ·sin θ with ρ = √(-ln u): the
    Box–Muller samples √(-2 ln u)·(cos θ, sin θ) divided by √2, so that output j < m/2, the sum
    of the cosine samples of pairs j and j + m/2, and output m/2 + j, the sum of their sine
    samples, come out normalised, and no output sums the two samples of one pair. |sin θ| is
    √|1 - cos²θ| and its sign is b's: one square root in place of a second trigonometric function
    (absolute error below 2·10⁻⁸, far under the float32 rounding of the output)."""
    m = n + (n & 1)
    h = m // 2
    words = _keystream(key, first_block, m, scratch.zeros, scratch.raw)
    a, b = words[:m], words[m:]
    rho, cos, sin = (row[:m] for row in scratch.f)
    np.right_shift(a, np.uint64(12), out=rho.view(np.uint64))
    np.bitwise_or(rho.view(np.uint64), _ONE, out=rho.view(np.uint64))
    np.subtract(2.0, rho, out=rho)
    np.log(rho, out=rho)
    np.negative(rho, out=rho)
    np.sqrt(rho, out=rho)
    np.multiply(b.view(np.int64), math.pi * 2.0 ** -63, out=sin)  # θ, for now
    theta, c = torch.from_numpy(sin), torch.from_numpy(cos)
    for s in range(0, m, _HALF):
        torch.cos(theta[s:s + _HALF], out=c[s:s + _HALF])
    np.multiply(cos, cos, out=sin)
    np.subtract(1.0, sin, out=sin)
    np.abs(sin, out=sin)  # cos θ may round to just past ±1
    np.sqrt(sin, out=sin)
    np.bitwise_and(b, _SIGN, out=b)
    np.bitwise_or(sin.view(np.uint64), b, out=sin.view(np.uint64))
    np.multiply(cos, rho, out=cos)
    np.multiply(sin, rho, out=sin)
    np.add(cos[:h], cos[h:], out=cos[:h])
    np.add(sin[:h], sin[h:], out=sin[:h])
    cos[h:n] = sin[:n - h]
    return cos[:n]


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


def _forget_pool() -> None:  # a forked child has none of its parent's threads (their pool would hang)
    global _POOL
    _POOL = _Pool()


os.register_at_fork(after_in_child=_forget_pool)


def _spans(flats: list, ends: list[int], start: int, z):
    """(piece of a tensor, its part of z) for the chunk z of the stream that starts at ``start``,
    the stream laid end to end over ``flats`` (``ends``: their cumulative sizes)."""
    stop = start + len(z)
    for k in range(bisect.bisect_right(ends, start), len(flats)):
        lo = ends[k] - flats[k].numel()
        if lo >= stop:
            break
        a, b = max(start, lo), min(stop, ends[k])
        yield flats[k][a - lo:b - lo], z[a - start:b - start]


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

    def add_noise_(self, tensors: list[torch.Tensor], std: float) -> None:
        """t += std·z for every t in order, z standard Gaussian (the stream continues)."""
        for t in tensors:
            t.add_(self.randn(t.shape, dtype=t.dtype, device=t.device), alpha=std)

    def generator(self) -> torch.Generator:
        raise NotImplementedError


class CipherStream(SecretStream):
    """AES-256-CTR under ``key``; block ``position`` is the next one not yet used."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError("a stream key has 256 bits")
        self._key = key
        self.position = 0
        self.device_position = 0  # ChaCha20 blocks used under the device key (see _device_chunks)

    def _take(self, blocks: int) -> int:
        first, self.position = self.position, self.position + blocks
        return first

    def _chunks(self, n: int, fn) -> None:
        """fn(start, z) for consecutive chunks z of the stream's next n Gaussians (float64, valid
        during the call), on the thread pool; chunk blocks are laid out in order, whatever the
        thread count."""
        starts = range(0, n, CHUNK)
        firsts = []
        for s in starts:
            k = min(CHUNK, n - s)
            firsts.append(self._take(k + (k & 1)))
        key = self._key

        def chunk(i):
            s = starts[i]
            fn(s, _gaussian_chunk(key, firsts[i], min(CHUNK, n - s), _POOL.scratch()))

        _POOL.map(chunk, range(len(firsts)))

    def _device_chunks(self, n: int, device, fn) -> None:
        """fn(start, z) for consecutive chunks z (float64, on ``device``) of the next n Gaussians of
        this stream's device half: ChaCha20 under HMAC(key, "device") in torch ops, so that a GPU's
        noise is drawn on the GPU (``chacha``). The two halves are independent streams; a stream
        gives the same numbers for the same draws on every device of a kind. Each call starts
        a fresh chunk (the compiled kernel has one shape)."""
        key = chacha.key_words(subkey(self._key, "device"), device)
        step = chacha.blocks_for(chacha.CHUNK)
        start = torch.tensor(self.device_position, dtype=torch.int64, device=device)
        for s in range(0, n, chacha.CHUNK):
            z = chacha.gaussian_chunk(key, start)
            start, self.device_position = start + step, self.device_position + step
            fn(s, z[:min(chacha.CHUNK, n - s)])

    def randn(self, shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = math.prod(shape)
        if chacha.draws_on(device) and n >= chacha.MIN_DRAW:
            out = torch.empty(n, dtype=dtype, device=device)
            self._device_chunks(n, out.device, lambda s, z: out[s:s + len(z)].copy_(z))
            return out.view(shape)
        out = np.empty(n, dtype=np.float64 if dtype == torch.float64 else np.float32)
        self._chunks(n, lambda s, z: np.copyto(out[s:s + len(z)], z))
        return torch.from_numpy(out).view(shape).to(device=device, dtype=dtype)

    def add_noise_(self, tensors: list[torch.Tensor], std: float) -> None:
        """t += std·z for every t, the z of all of them drawn as one stream and added chunk by
        chunk (no buffer of their size, the work spread over the pool). The sum is taken in
        float64 and rounded once to float32, float64 or float16; to bfloat16 torch rounds through
        float32 (twice: off by at most one unit in the last place, below the dtype's own rounding)."""
        devices = {t.device for t in tensors}
        if len(devices) == 1 and chacha.draws_on(next(iter(devices))):
            return self._add_noise_on_device(tensors, std)
        if any(d.type != "cpu" for d in devices) or not all(t.is_contiguous() for t in tensors):
            return super().add_noise_(tensors, std)
        flats = [t.detach().view(-1) for t in tensors]
        ends = np.cumsum([f.numel() for f in flats]).tolist()

        def add(start, z):
            np.multiply(z, std, out=z)
            for piece, part in _spans(flats, ends, start, z):
                if piece.dtype in (torch.float32, torch.float64, torch.float16):
                    target = piece.numpy()
                    np.add(target, part, out=target)
                else:  # bfloat16: torch, in slices that it runs on this thread
                    for i in range(0, len(part), _HALF):
                        piece[i:i + _HALF].add_(torch.from_numpy(part[i:i + _HALF]))

        self._chunks(ends[-1] if ends else 0, add)

    def _add_noise_on_device(self, tensors: list[torch.Tensor], std: float) -> None:
        """As add_noise_, on the tensors' (one) device, chunk by chunk: drawn there, or for a
        draw under ``chacha.MIN_DRAW`` taken from the AES stream and copied (one inline chunk:
        a device chunk computes 4M outputs, and the first one compiles its kernel)."""
        flats = [t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1) for t in tensors]
        ends = np.cumsum([f.numel() for f in flats]).tolist()
        n, device = (ends[-1] if ends else 0), tensors[0].device

        def add(start, z):
            for piece, part in _spans(flats, ends, start, z * std):
                # an in-place add of a float64 operand sums in float64 and rounds to the piece's
                # dtype (once for float32; through float32 for half types): one launch a span
                # (``copy_(piece.double() + part)`` took three and two temporaries, about 1,200
                # launches at RoBERTa-large's 390 tensors, where a GPU's DP step is bound by the host)
                piece.add_(part)

        if n >= chacha.MIN_DRAW:
            self._device_chunks(n, device, add)
        else:
            self._chunks(n, lambda start, z: add(start, torch.from_numpy(z).to(device)))
        for t, f in zip(tensors, flats):
            if not t.is_contiguous():  # reshape copied it
                t.detach().copy_(f.view(t.shape))

    def uniform(self, n: int) -> torch.Tensor:
        blocks = (n + 1) // 2
        raw = bytearray(blocks * _BLOCK + _BLOCK)
        words = _keystream(self._key, self._take(blocks), blocks, memoryview(bytes(blocks * _BLOCK)), raw)
        return torch.from_numpy(_uniform53(words.copy(), np.empty(2 * blocks))[:n])

    def generator(self) -> torch.Generator:
        """A CPU generator whose whole Mersenne-Twister state, 624 words of 32 bits, comes from the
        stream: ``manual_seed`` keeps only 32 bits of a seed, and 2³² trials would find those."""
        state = torch.Generator().manual_seed(0).get_state()
        mt = state.numpy()[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS].view(np.uint64)
        if state.numel() != _MT_STATE_BYTES or int(mt[0]) != 0 or int(mt[1]) != 1:  # seed 0: words 0, 1, ...
            raise RuntimeError("torch's CPU generator state has a layout this dpregistry does not know; "
                               "secret generators need it")
        blocks = _MT_WORDS // 2
        words = _keystream(self._key, self._take(blocks), blocks, memoryview(bytes(blocks * _BLOCK)),
                           bytearray((blocks + 1) * _BLOCK))
        np.bitwise_and(words, np.uint64(0xFFFFFFFF), out=mt)
        mt[0] |= np.uint64(0x80000000)  # never the all-zero state (as MT's init_by_array)
        g = torch.Generator()
        g.set_state(state)
        return g


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
