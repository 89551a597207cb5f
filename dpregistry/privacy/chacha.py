"""Secret Gaussians drawn on the tensors' own device: a ChaCha20 keystream in torch integer ops.

AES-CTR (``cryptography``) runs on the CPU: filling a GPU model's gradients from it made a
RoBERTa-large DP-Adam step on an H200 cost 9.7 non-private steps (1.9 s of noise for 366M
parameters, a step 0.25 s). ChaCha20 (Bernstein 2008; RFC 8439's block function, the generator
behind Linux's /dev/urandom) needs only 32-bit additions, XORs and rotations, so it runs as
element-wise tensor ops on any device; on a CUDA GPU a Triton kernel computes a chunk's 20 rounds
and its Gaussian transform in uint32 and float64 (:mod:`.chacha_triton`; ``torch.compile`` of
these ops took 0.09 s for 366M outputs on an H200, against 1.9 s from the host).

The state is the original one: 8 key words, a 64-bit block counter in words 12–13, a 64-bit
nonce (0: every stream has a key of its own) in words 14–15. The 32-bit words are held in
int64 tensors and masked, which keeps the arithmetic exact and defined on every device.
The Gaussians are those of :func:`dpregistry.privacy.secret._gaussian_chunk`, computed with the
same float64 formula from the same layout of 64-bit words, in torch.
"""

from __future__ import annotations

import math
import threading
import warnings

import torch

from ..progress import say

CHUNK = 1 << 22                   # outputs per call: a fixed shape, so the compiled kernel is reused
MIN_DRAW = 1 << 16                # smaller draws come from the host's AES stream (one chunk there)
WORDS64_PER_BLOCK = 8             # a 64-byte block is eight little-endian 64-bit words
_MASK = 0xFFFFFFFF
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"


def key_words(key: bytes, device) -> torch.Tensor:
    """A 256-bit key as its eight little-endian 32-bit words (a tensor input: no recompilation per key)."""
    return torch.tensor([int.from_bytes(key[i:i + 4], "little") for i in range(0, 32, 4)],
                        dtype=torch.int64, device=device)


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    return ((x << n) | (x >> (32 - n))) & _MASK


def _quarter(s: list, a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & _MASK
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & _MASK
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotl(s[b] ^ s[c], 7)


def keystream(key: torch.Tensor, first_block: torch.Tensor, blocks: int) -> torch.Tensor:
    """ChaCha20 blocks [first_block, first_block + blocks) as 64-bit words (int64, the bytes of
    the keystream read little-endian), ``8 · blocks`` of them, on ``key``'s device."""
    counter = first_block + torch.arange(blocks, dtype=torch.int64, device=key.device)
    zero = torch.zeros_like(counter)
    init = [zero + c for c in _SIGMA] + [zero + key[i] for i in range(8)] + \
           [counter & _MASK, (counter >> 32) & _MASK, zero, zero]
    s = list(init)
    for _ in range(10):  # 20 rounds: a column round and a diagonal round each time
        _quarter(s, 0, 4, 8, 12), _quarter(s, 1, 5, 9, 13), _quarter(s, 2, 6, 10, 14), _quarter(s, 3, 7, 11, 15)
        _quarter(s, 0, 5, 10, 15), _quarter(s, 1, 6, 11, 12), _quarter(s, 2, 7, 8, 13), _quarter(s, 3, 4, 9, 14)
    w = [(x + x0) & _MASK for x, x0 in zip(s, init)]
    return torch.stack([w[2 * j] | (w[2 * j + 1] << 32) for j in range(WORDS64_PER_BLOCK)], 1).reshape(-1)


def gaussians_from_words(words: torch.Tensor, n: int) -> torch.Tensor:
    """n float64 standard Gaussians from 2m 64-bit words, m = n rounded up to even: the layout and
    formula of ``secret._gaussian_chunk`` (pair j: radius word j, angle word m + j; each output the
    normalised sum of one sample of each of two pairs)."""
    m = n + (n & 1)
    h = m // 2
    a, b = words[:m], words[m:2 * m]
    one = (((a >> 12) & ((1 << 52) - 1)) | 0x3FF0000000000000).view(torch.float64)  # 1.f in [1, 2)
    rho = torch.sqrt(-torch.log(2.0 - one))                                            # u = 2 - 1.f in (0, 1]
    cos = torch.cos(b.to(torch.float64) * (math.pi * 2.0 ** -63))
    sin = (torch.sqrt(torch.abs(1.0 - cos * cos)).view(torch.int64) | (b & -(1 << 63))).view(torch.float64)
    cos, sin = cos * rho, sin * rho
    return torch.cat([cos[:h] + cos[h:], (sin[:h] + sin[h:])[:n - h]])


def blocks_for(n: int) -> int:
    """ChaCha blocks that a draw of n outputs reads (16 bytes of keystream per output)."""
    return -(-2 * (n + (n & 1)) // WORDS64_PER_BLOCK)


def _chunk(key: torch.Tensor, first_block: torch.Tensor) -> torch.Tensor:
    return gaussians_from_words(keystream(key, first_block, blocks_for(CHUNK)), CHUNK)


def compiles_on(device: torch.device) -> bool:
    """Whether chunks on ``device`` run as one Triton kernel (a CUDA GPU: :mod:`.chacha_triton`)."""
    return device.type == "cuda"


def draws_on(device) -> bool:
    """Whether tensors on ``device`` get their noise drawn there: any device but the CPU that has
    float64 arithmetic (MPS has none: its tensors get the host's noise, copied, as before)."""
    return torch.device(device).type not in ("cpu", "mps")


_kernels: dict[str, bool] = {}  # device -> whether its chunks come from the Triton kernel (settled)
_lock = threading.Lock()


def _triton_chunk(key: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    from . import chacha_triton  # imports triton: CUDA processes only
    return chacha_triton.gaussian_chunk(key, start, CHUNK)


def gaussian_chunk(key: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """CHUNK float64 Gaussians from blocks [start, start + blocks_for(CHUNK)), on ``key``'s
    device (``start``: a 0-d int64 tensor there, so that no chunk waits for a copy from the host):
    one Triton kernel on a CUDA GPU, torch ops elsewhere. Which of the two a device uses is
    settled by its first chunk (torch ops, with a warning, if the kernel fails to build): a later
    error is raised, not answered by switching paths in the middle of a run."""
    device = key.device
    if not compiles_on(device):
        return _chunk(key, start)
    name = str(device)
    if name not in _kernels:
        with _lock:
            if name not in _kernels:
                say(f"secret noise: building the noise kernel for {device}, once per process")
                try:
                    z, _kernels[name] = _triton_chunk(key, start), True
                    return z
                except Exception as e:  # no Triton, or no compiler for this device
                    warnings.warn(f"secret noise: building the ChaCha20 kernel for {device} failed "
                                  f"({type(e).__name__}); the noise is drawn by torch ops, slower",
                                  RuntimeWarning, stacklevel=2)
                    _kernels[name] = False
    return _triton_chunk(key, start) if _kernels[name] else _chunk(key, start)
