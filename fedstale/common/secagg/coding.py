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

import itertools
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


class Disagreement(ValueError):
    """The holders' answers do not fit one polynomial in a way that can be trusted."""


def fits(code: MaskCode, holders: Sequence[int], shares: np.ndarray) -> bool:
    """Whether answers of more than U holders lie on one polynomial of degree U - 1 (the
    first U's interpolation, evaluated at the others' points, gives their answers)."""
    base, rest = list(holders[: code.recovery]), list(holders[code.recovery :])
    if not rest:
        return True
    points = [code.alphas[j] for j in base]
    targets = [code.alphas[j] for j in rest]
    predicted = matmul(lagrange(targets, points, code.prime), shares[: code.recovery], code.prime)
    return bool(np.array_equal(predicted, shares[code.recovery :]))


def decode_checked(
    code: MaskCode, answers: dict[int, np.ndarray], wrong: int = 1, combinations: int = 5000
) -> tuple[np.ndarray, list[int]]:
    """The mask from the holders' answers, and the holders whose answers do not fit: the
    decode is right whenever at most `wrong` (f) answers are wrong, however they were made.

    A set of m >= U + f answers that fit one polynomial of degree U - 1 holds at least U
    right answers when at most f are wrong, and U right answers fix the polynomial: so it
    is the true one, and any answer off it is wrong. The answers are searched excluding
    k = 0, 1, ... holders while n - k >= U + f; every set that fits at the first such k
    must give the same mask (else more than f are wrong: Disagreement). With fewer than
    U + f answers, or none fitting, Disagreement: the caller drops the buffer rather than
    release a sum it cannot trust. Colluding holders (up to T) are covered with f = T."""
    holders = sorted(answers)
    n, needed = len(holders), code.recovery + wrong
    if n < needed:
        raise Disagreement(f"{n} answers cannot be checked: at least {needed} are needed")
    tried = 0
    for k in range(0, n - needed + 1):
        decoded: list[tuple[np.ndarray, list[int]]] = []
        for left_out in itertools.combinations(holders, k):
            tried += 1
            if tried > combinations:
                raise Disagreement("too many answers disagree to search which are wrong")
            kept = [j for j in holders if j not in left_out]
            if fits(code, kept, np.stack([answers[j] for j in kept])):
                base = kept[: code.recovery]
                mask = code.decode(base, np.stack([answers[j] for j in base]))
                decoded.append((mask, list(left_out)))
        if decoded:
            if any(not np.array_equal(mask, decoded[0][0]) for mask, _ in decoded):
                raise Disagreement(f"more than {wrong} of the {n} answers are wrong")
            return decoded[0][0], sorted(set().union(*(set(w) for _, w in decoded)))
    raise Disagreement(
        f"no {needed} of the {n} answers agree: more than {wrong} wrong (secagg-wrong-answers)"
    )
