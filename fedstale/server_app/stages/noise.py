"""Where a release's Gaussian noise comes from.

- default: NumPy's PCG64 seeded from the operating system's entropy once per run (and anew
  on resume). PCG64 is fast and statistically sound but not a cryptographically secure
  generator: whoever sees enough of its output could in principle recover its state and
  predict (and subtract) later noise.
- `dp-secure-noise=true`: a ChaCha20 keystream (the `cryptography` package Flower already
  requires) under a 256-bit key from `os.urandom`, drawn anew per run, a fresh nonce per
  release; its bits become uniforms (53 bits each), the uniforms Gaussians by the
  Box-Muller transform in float64, and each coordinate's noise is the sum of four such
  draws halved (the mitigation of Holohan and Braghin 2021, "Secure random sampling in
  differential privacy", which Opacus's secure mode applies to its own draws). This closes
  the prediction route. It does not make floating-point noise exact: Mironov's attack on
  the gaps of floating-point Laplace/Gaussian samples (2012) is made harder, not ruled
  out; only a discrete sampler (Canonne, Kamath and Steinke 2020) with integer arithmetic
  would. Timing of the sampler is not constant either.
- `dp-noise-seed` >= 0: a stream anyone with the seed can replay (tests only).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

NOISE_STREAM = 0xD9
SUMMED_DRAWS = 4  # Holohan and Braghin: the sum of 2n draws over sqrt(2n), n = 2
UNIFORM_BITS = 53
KEY_BYTES = 32


class SecureGaussian:
    """Gaussian draws from a ChaCha20 keystream; the one method the release uses of a
    NumPy Generator (`normal`)."""

    def __init__(self) -> None:
        self._key = os.urandom(KEY_BYTES)
        self._calls = 0

    def _bytes(self, count: int) -> bytes:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        self._calls += 1
        # cryptography's ChaCha20 nonce: a 4-byte block counter and a 12-byte nonce, here
        # the number of the call, so no two calls of one key share a keystream
        nonce = (0).to_bytes(4, "little") + self._calls.to_bytes(12, "little")
        encryptor = Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor()
        return encryptor.update(bytes(count))

    def uniform(self, count: int) -> np.ndarray:
        """`count` uniforms in (0, 1]: 53 random bits each, plus one half step."""
        words = np.frombuffer(self._bytes(8 * count), dtype=np.uint64)
        return ((words >> np.uint64(64 - UNIFORM_BITS)).astype(np.float64) + 0.5) * 2.0**-53

    def standard_normal(self, count: int) -> np.ndarray:
        pairs = (count + 1) // 2
        u1, u2 = self.uniform(pairs), self.uniform(pairs)
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = 2.0 * np.pi * u2
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]

    def normal(self, loc: float, scale: float, size: Any) -> np.ndarray:
        shape = (size,) if isinstance(size, int) else tuple(size)
        count = int(np.prod(shape))
        summed = sum(self.standard_normal(count) for _ in range(SUMMED_DRAWS))
        halved = summed / np.sqrt(SUMMED_DRAWS)
        return (loc + scale * halved).reshape(shape)


def noise_source(secure: bool) -> Any:
    """The run's noise generator: fresh from the operating system either way."""
    return SecureGaussian() if secure else np.random.default_rng()


def replayable_stream(seed: int, version: int) -> np.random.Generator:
    """Release `version`'s noise under `dp-noise-seed`: anyone with the seed replays it."""
    return np.random.default_rng([seed, NOISE_STREAM, version])
