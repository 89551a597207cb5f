"""Randomness, split into public and secret streams.

Everything public (shuffled and single-pass batches, directions, projectors, O2NC's random
points, the output iterate) is a pure function of the run seed, a purpose and the step: a replica
or a resumed run regenerates it from the step alone, and logs can name the seeds.

The privacy noise and the sampling that amplification rests on (Poisson membership, uniformly
drawn batches) are secret: an adversary who can regenerate the noise subtracts it, and one who
can regenerate the batches knows when a record was used. They come from :meth:`RunRNG.secret`, in
one of three modes (``privacy.noise``):

* ``secure`` (default): a 256-bit key from the operating system's entropy, drawn when the run
  (or a resume) starts and never written anywhere; AES-256-CTR streams under it
  (:mod:`dpregistry.privacy.secret`). A resumed run continues with a fresh key.
* ``keyed``: the key derives from the secret in ``DPREG_NOISE_KEY`` (at least 128 bits of
  entropy). The run reproduces bit for bit for whoever holds the key; checkpoints keep only an
  HMAC fingerprint of it, and a resume must be given the same key.
* ``reproducible``: torch's generator seeded from the recipe's seed, for research and tests. Anyone
  with the recipe can regenerate the noise and subtract it, so the ε is no privacy guarantee.
"""

from __future__ import annotations

import hashlib
import os
import re

import torch

from .errors import UserError
from .privacy.secret import CipherStream, SecretStream, SeededStream, fingerprint, label_bytes, new_key, subkey

NOISE_KEY_ENV = "DPREG_NOISE_KEY"
NOISE_MODES = ("secure", "keyed", "reproducible")
MAKE_A_KEY = 'python -c "import secrets; print(secrets.token_hex(32))"'


def derive(*parts: object) -> int:
    """A 63-bit integer from SHA-256 of the parts (stable across processes and platforms)."""
    h = hashlib.sha256(label_bytes(*parts)).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _patterned(text: str) -> bool:
    """A text that repeats itself ("0123456789abcdef" twice) or steps through its alphabet evenly
    ("02468ace..."): typed, not drawn. A random key of 32 characters is either with probability
    below 16⁻¹⁶, so no drawn key is refused; words and passphrases are not caught (a heuristic)."""
    n = len(text)
    if any(all(text[i] == text[i + p] for i in range(n - p)) for p in range(1, n // 2 + 1)):
        return True
    steps = {ord(b) - ord(a) for a, b in zip(text, text[1:])}
    return len(steps) <= 2  # a run like "abc...xyz" or "0123456789abcdef" (one jump between ranges)


def key_from_env(text: str | None) -> bytes:
    """The 256-bit run key of ``keyed`` mode, from DPREG_NOISE_KEY; refuses a key with less than 128
    bits of entropy: at least 32 hex digits, or 22 base64 characters."""
    if not text:
        raise UserError(f"keyed noise needs the secret key in {NOISE_KEY_ENV}; make one with {MAKE_A_KEY}")
    text = text.strip()
    hexadecimal = re.fullmatch(r"[0-9a-fA-F]+", text) is not None
    base64 = re.fullmatch(r"[A-Za-z0-9+/_-]+={0,2}", text) is not None
    strong = (len(text) >= 32 if hexadecimal else base64 and len(text.rstrip("=")) >= 22) and len(set(text)) >= 8
    if not strong or _patterned(text.rstrip("=").lower() if hexadecimal else text.rstrip("=")):
        raise UserError(f"{NOISE_KEY_ENV} is too weak for a secret noise key (it needs at least 128 random bits: "
                        f"32 hex digits or 22 base64 characters); make one with {MAKE_A_KEY}")
    return subkey(b"dpregistry-keyed-noise", text)


class RunRNG:
    def __init__(self, seed: int, mode: str = "secure", key: bytes | None = None, run: str = ""):
        """``key``: the secret key of a secure run shared by rank 0 (default: a fresh one), or of
        a keyed run (default: from DPREG_NOISE_KEY). ``run``: what identifies the run beside its
        seed (the recipe's hash); a keyed run's streams are keyed by HMAC(key, seed, run), so two
        runs under one key that differ in seed or recipe draw independent noise and batches (the
        same noise on two releases would cancel in their difference). Runs that differ only in
        data the recipe does not name (``dpregistry.train``'s own data) still need a key each."""
        if mode not in NOISE_MODES:
            raise ValueError(f"noise mode {mode!r}")
        self.seed = int(seed)
        self.noise_mode = mode
        if mode == "secure":
            self._key = key or new_key()
        elif mode == "keyed":
            self._key = subkey(key or key_from_env(os.environ.get(NOISE_KEY_ENV)), "dpregistry-run", self.seed, run)
        else:
            self._key = None

    @property
    def guarantee(self) -> bool:
        """Whether the noise is secret, so the reported ε is a privacy guarantee."""
        return self.noise_mode != "reproducible"

    @property
    def replayable(self) -> bool:
        """Whether a resumed run redraws the same noise (not in secure mode: the key is new)."""
        return self.noise_mode != "secure"

    @property
    def key(self) -> bytes | None:
        """The secret key (to share with the other ranks once, when the run starts)."""
        return self._key

    @property
    def noise_fingerprint(self) -> str | None:
        """Identifies a keyed run's key without revealing it (stored in checkpoints)."""
        return fingerprint(self._key) if self.noise_mode == "keyed" else None

    def step_seed(self, purpose: str, step: int, *extra: object) -> int:
        """Public seed for ``purpose`` at ``step``."""
        return derive("dpregistry-public", self.seed, purpose, step, *extra)

    def generator(self, purpose: str, step: int, *extra: object, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed(self.step_seed(purpose, step, *extra))
        return g

    #: secret streams the stages drew (``Randomness.secret``): the run tells a batch drawn from one
    stage_secrets = 0

    def secret(self, purpose: str, step: int, *extra: object) -> SecretStream:
        """The secret stream of ``purpose`` at ``step`` (identical on every rank that holds the key)."""
        if self._key is None:
            return SeededStream(derive("dpregistry-noise", self.seed, purpose, step, *extra))
        return CipherStream(subkey(self._key, "dpregistry-secret", purpose, step, *extra))

    def noise(self, step: int, call: int = 0) -> SecretStream:
        """The privacy noise of release number ``call`` within ``step``."""
        return self.secret("noise", step, call)


def noise_statement(mode: str) -> str:
    """What the noise mode means for the reported ε, in words (summary, report, model card)."""
    return {"secure": "secret, drawn under a fresh key from the operating system's entropy, never stored",
            "keyed": "secret, drawn under the key in DPREG_NOISE_KEY (reproducible only with that key)",
            "reproducible": "reproducible from the recipe seed: the ε is NOT a privacy guarantee, since anyone "
                            "with the recipe can regenerate the noise and subtract it"}[mode]
