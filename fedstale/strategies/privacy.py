"""Central differential privacy for asynchronous releases, as plain arrays: each update's
delta clipped to a norm C, and Gaussian noise added once per release (a buffer flush, a
FIFO aggregation, a FedAsync step) with standard deviation z * S, where z is the noise
multiplier and S the release's sensitivity: how far the released change of the global
model can move when one client's update is replaced by any other update of norm <= C.

Flower's fixed-clipping wrappers (flwr.serverapp.strategy) add z * C / m to the mean of m
clipped updates; a release here is any weighted sum of clipped deltas, and S follows its
weights:

- `linear_sensitivity`: sum_i w_i d_i with weights that do not depend on the deltas
  (FedBuff's eta/K * s(tau), SAFL FedSGD's 1/K, FedAsync's a_t, a plain mean's 1/m).
  Neighbouring runs differ in one client's contributions, zeroed under the same public
  dispatch schedule (the zero-out relation of Kairouz et al. 2021), and one client may
  hold several updates of a release (a fast client cycling within a FedBuff buffer,
  `buffer-size` above the client count, `prefetch`, a late reply): zeroing all of client
  j's deltas moves the sum by sum_{i of j} w_i d_i, at most (sum_{i of j} |w_i|) C, so
  S = C max_j sum_{i of j} |w_i| (Flower's z C / m for a mean of m clients, one update
  each).
- `convex_sensitivity`: sum_i w_i d_i whose weights themselves come from the clients'
  data (FedPSA's softmax over sketch distances) but form a convex combination scaled by
  `scale` (w_i >= 0, sum w_i = scale): both sums lie in the ball of radius scale * C, so
  one client's replacement moves the release by at most 2 * scale * C, S = 2 scale C.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedstale.common.config import RunSettings

LINEAR = "linear"
CONVEX = "convex"


def clip_to(delta: np.ndarray, norm: float) -> tuple[np.ndarray, float]:
    """`delta` scaled down to L2 norm `norm` if longer (float64 norm, float32 result), and
    the factor applied (1.0: it was within)."""
    if norm <= 0:
        raise ValueError(f"clipping norm must be > 0, got {norm}")
    length = float(np.linalg.norm(delta.astype(np.float64)))
    factor = min(1.0, norm / length) if length > 0 else 1.0
    return (delta * np.float32(factor)).astype(np.float32), factor


def linear_sensitivity(
    weights: Sequence[float], clipping_norm: float, clients: Sequence[int] | None = None
) -> float:
    """S of sum_i w_i d_i over deltas clipped to `clipping_norm`, weights independent of
    the deltas, one client's contributions zeroed: C times the largest sum, over the
    clients, of a client's |w_i| (`clients[i]`: whose update i is; None: one each)."""
    if len(weights) == 0:
        return 0.0
    owners = range(len(weights)) if clients is None else clients
    per_client: dict[int, float] = {}
    for owner, weight in zip(owners, weights, strict=True):
        per_client[owner] = per_client.get(owner, 0.0) + abs(float(weight))
    return max(per_client.values()) * clipping_norm


def convex_sensitivity(scale: float, clipping_norm: float) -> float:
    """S of a data-dependent convex combination of clipped deltas times `scale`:
    2 * scale * C."""
    return 2.0 * abs(scale) * clipping_norm


def release_sensitivity(
    kind: str, weights: Sequence[float], clipping_norm: float, clients: Sequence[int] | None = None
) -> float:
    """S of one release from the weights its updates got and whose they were: C times the
    largest per-client sum of weights for a linear release, 2 * (sum of the weights) * C for
    a data-dependent convex one (however many of its updates one client holds)."""
    if kind == LINEAR:
        return linear_sensitivity(list(weights), clipping_norm, clients)
    if kind == CONVEX:
        return convex_sensitivity(float(np.sum(weights)), clipping_norm)
    raise ValueError(f"unknown release kind '{kind}'")


def one(run: RunSettings, params: Any) -> int:
    return 1


def buffered(run: RunSettings, params: Any) -> int:
    """K of a rule whose Params derive from BufferParams (fedstale/strategies/buffer.py)."""
    return int(params.buffer_size)


def cohort(run: RunSettings, params: Any) -> int:
    return run.concurrency


@dataclass(frozen=True)
class Release:
    """How a rule releases a new global model under DP, declared beside the rule: the
    `kind` of its sensitivity (LINEAR or CONVEX) and how many updates one release holds
    (`per_release(run, params)`: Flower's `num_sampled_clients`)."""

    kind: str
    per_release: Callable[[RunSettings, Any], int] = buffered
    # the rule's kept attributes that hold only released models and the public schedule:
    # under DP (client values omitted) a checkpoint keeps these alone, the others start
    # afresh on resume
    public: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in (LINEAR, CONVEX):
            raise TypeError(f"Release kind must be '{LINEAR}' or '{CONVEX}', got '{self.kind}'")


def noise_std(noise_multiplier: float, sensitivity: float) -> float:
    """The Gaussian mechanism's standard deviation for one release: z * S."""
    return noise_multiplier * sensitivity


def noised(
    change: np.ndarray, noise_multiplier: float, sensitivity: float, rng: np.random.Generator
) -> np.ndarray:
    """A release's change of the global model with its Gaussian noise added (float32)."""
    std = noise_std(noise_multiplier, sensitivity)
    noise = rng.normal(0.0, std, size=change.shape) if std > 0 else 0.0
    return (change.astype(np.float64) + noise).astype(np.float32)
