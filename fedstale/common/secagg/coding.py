"""Encoded masks (LightSecAgg, So et al. MLSys 2022, Section 4; its buffered asynchronous
form, BASecAgg, So, Ali, Guler and Avestimehr 2021): a client's random mask z, of the
model's length d, is cut into U - T pieces of length m = ceil(d / (U - T)); T pieces of
uniform noise are added; the U pieces are the values at points beta_1..beta_U of one
polynomial of degree U - 1, and holder j's share is that polynomial's value at alpha_j
(a Lagrange code, the `encode` matrix). Then

- any T shares are independent of the mask (the T noise pieces hide it: privacy against
  T colluding holders);
- any U shares give back every piece (`decode`), and since encoding is linear, U shares of
  sum_i W_i [z_i]_j, each computed by one holder from the shares it holds, give back
  sum_i W_i z_i: the mask of any weighted buffer of updates, from any rounds, while U of
  the N holders answer (dropout tolerance N - U).

Points: beta_k = k (k = 1..U), alpha_j = U + j (j = 1..N), all distinct in F_p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedstale.common.secagg.field import FIELD_DTYPE, PRIME, random_elements


def inverse(value: int, prime: int = PRIME) -> int:
    return pow(value % prime, prime - 2, prime)


def lagrange(targets: Sequence[int], points: Sequence[int], prime: int = PRIME) -> np.ndarray:
    """The matrix L with L[t, k] = the k-th Lagrange basis polynomial of `points` at
    `targets[t]`: values at `points` times L^T are the polynomial's values at `targets`.
    Kept per (targets, points): every task of a run encodes with the same matrix."""
    return _lagrange(tuple(targets), tuple(points), prime).copy()


@lru_cache(maxsize=64)
def _lagrange(targets: tuple[int, ...], points: tuple[int, ...], prime: int) -> np.ndarray:
    # denominators are the same for every target: prod_{other != point} (point - other)
    denominators = []
    for point in points:
        denominator = 1
        for other in points:
            if other != point:
                denominator = denominator * (point - other) % prime
        denominators.append(inverse(denominator, prime))
    matrix = np.zeros((len(targets), len(points)), dtype=np.uint64)
    for t, target in enumerate(targets):
        if target in points:  # the basis is 1 at its own point, 0 at the others
            matrix[t, points.index(target)] = 1
            continue
        total = 1
        for other in points:
            total = total * (target - other) % prime
        for k, point in enumerate(points):
            # prod_{other != point} (target - other) = total / (target - point)
            numerator = total * inverse(target - point, prime) % prime
            matrix[t, k] = numerator * denominators[k] % prime
    return matrix


def matmul(matrix: np.ndarray, rows: np.ndarray, prime: int = PRIME) -> np.ndarray:
    """`matrix` (small, Python ints below p) times `rows` (field elements), in the field:
    each product below 2^64, reduced before it is added."""
    out = np.zeros((matrix.shape[0], rows.shape[1]), dtype=FIELD_DTYPE)
    columns = np.asarray(matrix, dtype=FIELD_DTYPE)
    for k in range(columns.shape[1]):
        out = (out + (columns[:, k : k + 1] * rows[k][None, :]) % prime) % prime
    return out


@dataclass(frozen=True)
class MaskCode:
    """The code for N holders, privacy against T colluders, recovery from any U shares."""

    holders: int  # N
    privacy: int  # T
    recovery: int  # U
    length: int  # d, the model's length
    prime: int = PRIME

    def __post_init__(self) -> None:
        if not 0 <= self.privacy < self.recovery <= self.holders:
            raise ValueError(
                f"secure aggregation needs 0 <= T < U <= N, got T={self.privacy}, "
                f"U={self.recovery}, N={self.holders}"
            )

    @property
    def pieces(self) -> int:
        return self.recovery - self.privacy

    @property
    def share_length(self) -> int:
        return -(-self.length // self.pieces)

    @property
    def betas(self) -> list[int]:
        return list(range(1, self.recovery + 1))

    @property
    def alphas(self) -> list[int]:
        return [self.recovery + j for j in range(1, self.holders + 1)]

    @property
    def encoder(self) -> np.ndarray:
        return lagrange(self.alphas, self.betas, self.prime)

    def encode(self, mask: np.ndarray) -> np.ndarray:
        """The N shares (N x m) of `mask` (d field elements), with fresh noise pieces."""
        m = self.share_length
        padded = np.zeros(self.pieces * m, dtype=FIELD_DTYPE)
        padded[: self.length] = mask
        noise = random_elements(self.privacy * m, self.prime)
        pieces = np.concatenate([padded, noise]).reshape(self.recovery, m)
        return matmul(self.encoder, pieces, self.prime)

    def decode(self, holders: Sequence[int], shares: np.ndarray) -> np.ndarray:
        """The mask (d field elements) from U shares (U x m) of holders `holders` (indices
        0..N-1, distinct): of one mask, or of any weighted sum of masks."""
        if len(set(holders)) != self.recovery or len(holders) != self.recovery:
            raise ValueError(f"decoding needs the shares of {self.recovery} distinct holders")
        points = [self.alphas[j] for j in holders]
        decoder = lagrange(self.betas[: self.pieces], points, self.prime)
        return matmul(decoder, shares, self.prime).reshape(-1)[: self.length]
