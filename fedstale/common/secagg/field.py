"""The finite field the masked updates live in, and the quantisation into it.

An update's delta is clipped coordinate-wise to [-R, R] (`clip_range`) and rounded towards
zero to a multiple of 2^-f (`precision_bits` f): q = trunc(x 2^f), an integer in
[-R 2^f, R 2^f], held in F_p as q mod p. The weights of a buffer (staleness weights, a 1/K)
are public; each is taken relative to the buffer's largest, s = max |w_i|, and rounded
towards zero the same way to W_i = trunc(w_i / s 2^g) (`weight_bits` g). Rounding towards
zero never lengthens an update nor enlarges its weight, so a clipped update's contribution
stays within |w_i| C and central DP's sensitivity holds unchanged. The server's weighted
sum of the quantised deltas, sum_i W_i q_i, is an integer of scale 2^(f+g) / s, which
decodes exactly as long as its magnitude stays below p / 2 (`fits`: sum_i |W_i| R 2^f <
p / 2). The decoded sum differs from sum_i w_i x_i (with x_i within [-R, R]) by at most
sum_i (|w_i - s W_i 2^-g| R + s |W_i| 2^-g 2^-f) per coordinate (`error_bound`). The prime
is below 2^32, so a product of two elements fits in 64 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PRIME = 4_294_967_291  # 2^32 - 5, the largest prime below 2^32
FIELD_DTYPE = np.uint64  # arithmetic: a product of two elements fits
WIRE_DTYPE = np.uint32  # on the wire: every element fits in 32 bits


@dataclass(frozen=True)
class Quantiser:
    clip_range: float = 1.0  # R: each coordinate of a delta is clipped to [-R, R]
    precision_bits: int = 16  # f: a delta's coordinates are multiples of 2^-f
    weight_bits: int = 10  # g: a weight is a multiple of 2^-g
    prime: int = PRIME

    def quantise(self, vector: np.ndarray) -> np.ndarray:
        """`vector` clipped to [-R, R], rounded towards zero to 2^-f, as field elements."""
        clipped = np.clip(np.asarray(vector, np.float64), -self.clip_range, self.clip_range)
        integers = np.trunc(clipped * 2.0**self.precision_bits).astype(np.int64)
        return np.mod(integers, self.prime).astype(FIELD_DTYPE)

    def weight_units(self, weights: Sequence[float]) -> tuple[list[int], float]:
        """The integers W_i = trunc(w_i / s 2^g) and the scale s = max |w_i|."""
        top = max((abs(float(w)) for w in weights), default=0.0) or 1.0
        return [int(float(w) / top * 2**self.weight_bits) for w in weights], top

    def decode(self, total: np.ndarray, top: float) -> np.ndarray:
        """A weighted sum in the field (units of `weight_units` with scale `top`) back to
        float64: elements above p / 2 are the negative integers."""
        values = np.asarray(total, np.int64)
        signed = np.where(values > self.prime // 2, values - self.prime, values)
        return signed.astype(np.float64) * (top / 2.0 ** (self.precision_bits + self.weight_bits))

    def in_range(self, total: np.ndarray, factors: Sequence[int]) -> bool:
        """Whether a decoded weighted sum (field elements) is one that deltas within
        [-R, R] can give: every coordinate at most sum_i |W_i| R 2^f in magnitude."""
        values = np.asarray(total, np.int64)
        signed = np.where(values > self.prime // 2, values - self.prime, values)
        largest = sum(abs(int(f)) for f in factors) * int(self.clip_range * 2**self.precision_bits)
        return bool(np.all(np.abs(signed) <= largest))

    def fits(self, count: int) -> bool:
        """Whether a weighted sum of `count` updates always decodes: at most
        count 2^g R 2^f in magnitude, below p / 2."""
        largest = count * 2**self.weight_bits * self.clip_range * 2**self.precision_bits
        return largest < self.prime // 2

    def error_bound(self, weights: Sequence[float]) -> float:
        """The largest difference, per coordinate, between the decoded weighted sum and
        sum_i w_i x_i for deltas within [-R, R]."""
        units, top = self.weight_units(weights)
        step = top * 2.0**-self.weight_bits
        bound = 0.0
        for weight, unit in zip(weights, units, strict=True):
            bound += abs(weight - unit * step) * self.clip_range
            bound += abs(unit) * step * 2.0**-self.precision_bits
        return bound


def add(a: np.ndarray, b: np.ndarray, prime: int = PRIME) -> np.ndarray:
    return ((a.astype(FIELD_DTYPE) + b.astype(FIELD_DTYPE)) % prime).astype(FIELD_DTYPE)


def subtract(a: np.ndarray, b: np.ndarray, prime: int = PRIME) -> np.ndarray:
    return ((a.astype(FIELD_DTYPE) + (prime - b.astype(FIELD_DTYPE) % prime)) % prime).astype(
        FIELD_DTYPE
    )


def scale(vector: np.ndarray, factor: int, prime: int = PRIME) -> np.ndarray:
    """`factor` (any integer) times `vector`, in the field."""
    return ((vector.astype(FIELD_DTYPE) % prime) * FIELD_DTYPE(factor % prime)) % prime


def weighted_sum(
    vectors: Sequence[np.ndarray], factors: Sequence[int], prime: int = PRIME
) -> np.ndarray:
    """sum_i factors_i vectors_i in the field."""
    total = np.zeros_like(np.asarray(vectors[0]), dtype=FIELD_DTYPE)
    for vector, factor in zip(vectors, factors, strict=True):
        total = add(total, scale(vector, factor, prime), prime)
    return total


def random_elements(count: int, prime: int = PRIME) -> np.ndarray:
    """`count` uniform field elements from the operating system's CSPRNG (64 random bits
    reduced mod p: a bias below 2^-32 per element)."""
    import os

    words = np.frombuffer(os.urandom(8 * count), dtype=FIELD_DTYPE)
    return words % FIELD_DTYPE(prime)


def to_wire(vector: np.ndarray) -> np.ndarray:
    return np.asarray(vector).astype(WIRE_DTYPE)


def from_wire(vector: np.ndarray) -> np.ndarray:
    return np.asarray(vector).astype(FIELD_DTYPE)


def in_field(vector: np.ndarray, prime: int = PRIME) -> bool:
    """A vector a client sent is made of field elements: unsigned 32-bit, each below p."""
    return vector.dtype == WIRE_DTYPE and bool(np.all(vector < prime))
