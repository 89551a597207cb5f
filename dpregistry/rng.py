"""Randomness, split into public and secret streams.

Everything public (shuffled and single-pass batches, directions, projectors, O2NC's random
points, the output iterate) is a pure function of the run seed, a purpose and the step: a replica or a resumed run
regenerates it from the step alone, and logs can name the seeds.

Privacy noise comes from a separate key, in one of three modes (``RunRNG.noise_mode``). So does
the sampling that privacy amplification rests on (Poisson membership, uniformly drawn batches:
``sampling_seed``): an adversary who can regenerate the batches knows when a record was used, and
the amplified guarantee no longer holds. It is as secret as the noise in each mode:

* ``seeded`` (default): the key is derived one-way (SHA-256) from the run seed under its own
  domain, so no public step seed determines it (DPZero spec §7, coupling 6: the released code
  derived the noise from the direction seed). Runs reproduce bit for bit, but anyone who knows the
  recipe's seed can regenerate the noise: fine for research, not for a release.
* ``keyed``: the key is the secret in the environment variable ``DPREG_NOISE_KEY``. The run
  reproduces for whoever holds the key and for nobody else; checkpoints store only a fingerprint
  of it, and a resume must be given the same key.
* ``secure`` (``privacy.secure_noise: true``): every draw comes from the operating system's
  entropy (dpregistry.secure_noise); nothing but the noise and the sampled batches changes
  between runs.
"""

from __future__ import annotations

import hashlib
import os

import torch


def derive(*parts: object) -> int:
    """A 63-bit integer from SHA-256 of the parts (stable across processes and platforms)."""
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


NOISE_KEY_ENV = "DPREG_NOISE_KEY"


class RunRNG:
    def __init__(self, seed: int, secure_noise: bool = False, noise_key: str | None = None):
        self.seed = int(seed)
        self.secure_noise = secure_noise
        if noise_key is None:
            noise_key = os.environ.get(NOISE_KEY_ENV) or None
        if secure_noise:
            self.noise_mode = "secure"
            self._noise_key = os.urandom(32).hex()  # never written anywhere
        elif noise_key:
            self.noise_mode = "keyed"
            self._noise_key = hashlib.sha256(f"dpregistry-noise-key\x1f{noise_key}".encode()).hexdigest()
        else:
            self.noise_mode = "seeded"
            self._noise_key = hashlib.sha256(f"dpregistry-noise\x1f{self.seed}".encode()).hexdigest()

    @property
    def noise_fingerprint(self) -> str | None:
        """Identifies a keyed noise key without revealing it (stored in checkpoints)."""
        if self.noise_mode != "keyed":
            return None
        return hashlib.sha256(f"dpregistry-noise-fingerprint\x1f{self._noise_key}".encode()).hexdigest()[:16]

    def step_seed(self, purpose: str, step: int, *extra: object) -> int:
        """Public seed for ``purpose`` at ``step``."""
        return derive("dpregistry-public", self.seed, purpose, step, *extra)

    def sampling_seed(self, purpose: str, step: int, *extra: object) -> int:
        """Seed of the batch sampling at ``step`` whose secrecy the amplified accounting assumes.

        Seeded mode: the public seed (nothing is secret from the recipe seed in that mode, and
        runs keep their batches). Keyed: derived from the secret key. Secure: fresh OS entropy."""
        if self.noise_mode == "seeded":
            return self.step_seed(purpose, step, *extra)
        if self.noise_mode == "keyed":
            return derive("dpregistry-sampling", self._noise_key, purpose, step, *extra)
        return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)

    def generator(self, purpose: str, step: int, *extra: object, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.step_seed(purpose, step, *extra))
        return g

    def noise(self, step: int, call: int = 0) -> "NoiseSource":
        """Secret source of the privacy noise of release number ``call`` within ``step``."""
        if self.secure_noise:
            return SecureNoise()
        return SeededNoise(derive("dpregistry-noise", self._noise_key, step, call))


class NoiseSource:
    """Draws standard Gaussian noise; privatizers never see where it comes from."""

    def randn(self, shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
        raise NotImplementedError


class SeededNoise(NoiseSource):
    """Reproducible noise from a secret seed (default mode: bitwise resume and replay)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}

    def randn(self, shape, dtype=torch.float32, device="cpu"):
        key = str(torch.device(device))
        if key not in self._gens:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._gens[key] = g
        return torch.randn(shape, generator=self._gens[key], dtype=dtype, device=device)


class SecureNoise(NoiseSource):
    """Noise from the operating system's entropy (see :mod:`dpregistry.secure_noise`)."""

    def randn(self, shape, dtype=torch.float32, device="cpu"):
        from .secure_noise import secure_randn
        return secure_randn(shape, dtype=dtype, device=device)
