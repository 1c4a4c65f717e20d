"""FedQS: semi-asynchronous FL with client-type adaptation (papers/fedqs-summary.md; the
exact rule is ALGORITHMS.md's FedQS section, after the authors' `_multi` code).

The rule's pieces as plain functions: the similarity computed at dispatch, the four client
types, their lr / momentum actions and the feedback-weighted aggregation; each is
unit-tested against values worked by hand (tests/test_fedqs.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FBC, SBC, FUC, SUC = "FBC", "SBC", "FUC", "SUC"  # fast/slow, misaligned ("biased")/aligned
TYPES = (FBC, SBC, FUC, SUC)
SIMILARITIES = ("angle", "l1", "l2")
Segments = Sequence[tuple[int, int]]  # (start, stop) of each parameter tensor in a flat vector


def minmax_angle(a: np.ndarray, b: np.ndarray) -> float | None:
    """Degrees between `a` and `b` after min-max normalising each to [0, 1] (so 0-90);
    None where either is constant (the authors skip such a tensor)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    spans = (a64.max() - a64.min(), b64.max() - b64.min())
    if spans[0] == 0 or spans[1] == 0:
        return None
    na, nb = (a64 - a64.min()) / spans[0], (b64 - b64.min()) / spans[1]
    cosine = float(na @ nb / (np.linalg.norm(na) * np.linalg.norm(nb)))
    return math.degrees(math.acos(min(1.0, max(-1.0, cosine))))


def similarity(a: np.ndarray, b: np.ndarray, segments: Segments, kind: str) -> float | None:
    """Mean over parameter tensors of the min-max angle (`angle`), or of the L1 / L2 norm of
    the difference (`l1`, `l2`: the authors' simi1 / simi2 ablations); None if no tensor
    counts (angle: every tensor constant in a or b)."""
    values = []
    for start, stop in segments:
        x, y = a[start:stop], b[start:stop]
        if kind == "angle":
            value = minmax_angle(x, y)
        else:
            diff = np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)
            value = float(np.linalg.norm(diff, ord=1 if kind == "l1" else 2))
        if value is not None:
            values.append(value)
    return float(np.mean(values)) if values else None


def mean_nonzero(values: np.ndarray) -> float:
    """The thresholds' rule: the mean of the non-zero entries (0 when there are none)."""
    kept = values[values != 0]
    return float(kept.mean()) if kept.size else 0.0


def classify(speed: float, theta: float | None, speed_ths: float, theta_ths: float) -> str | None:
    """A client's type, or None when it cannot be classified yet (no speed, no thresholds,
    no angle)."""
    if speed <= 0 or speed_ths <= 0 or theta_ths <= 0 or theta is None:
        return None
    fast, misaligned = speed > speed_ths, theta > theta_ths
    if misaligned:
        return FBC if fast else SBC
    return FUC if fast else SUC


def aligned_momentum(theta: float, theta_ths: float, m0: float, k: float, cap: float) -> float:
    """FUC / SUC: m0 + min(k (m0 theta_ths / theta - m0), cap); m0 + cap at theta 0."""
    if theta == 0:
        return m0 + cap
    return m0 + min(k * (m0 * theta_ths / theta - m0), cap)


def new_lr(kind: str, lr: float, factor: float, a: float, bounds: tuple[float, float]) -> float:
    """FBC keeps its lr, FUC lowers it by a F, SBC and SUC raise it by a F; clipped."""
    step = {FBC: 0.0, SBC: a * factor, FUC: -a * factor, SUC: a * factor}[kind]
    return min(bounds[1], max(bounds[0], lr + step))


def speed_factor(speed: float, speed_ths: float, cap: float = 9.0) -> float:
    """F = min(speed_ths / speed_i, 9)."""
    return min(speed_ths / speed, cap)


def sbc_action(spread: float, m0: float, limit: float) -> tuple[float, bool]:
    """An SBC client's momentum and feedback flag from its per-class accuracy spread (in
    points): a wide spread turns momentum off and asks for the feedback weight."""
    wide = spread >= limit
    return (0.0 if wide else m0), wide


def aggregation_weights(
    examples: np.ndarray,
    counts: np.ndarray,
    total_count: float,
    flags: np.ndarray,
    thetas: np.ndarray,
    theta_bar: float,
) -> np.ndarray:
    """p_i = n_i / sum n; a flagged update's p_i *= (e/2)^(0.1 - f_i / sum_j f_j)
    * (1 + min(theta_i / theta_bar, 2)^2); then renormalised. `counts`: each update's
    client's f_i after this aggregation's increments; `total_count`: sum over all N."""
    p = np.asarray(examples, dtype=np.float64) / float(np.sum(examples))
    for i in np.flatnonzero(flags):
        ratio = min(thetas[i] / theta_bar, 2.0) if theta_bar > 0 else 0.0
        p[i] *= (math.e / 2) ** (0.1 - counts[i] / total_count) * (1 + ratio**2)
    return p / p.sum()
