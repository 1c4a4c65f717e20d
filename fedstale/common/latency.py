"""Client latency profiles in virtual time units (FLGo: 86,400 units per virtual day).

- uniform(a, b): each client's latency drawn once from U(a, b) (FLGo's UNI-a-b).
- long-tail(a, b): most clients fast, a few very slow: a * X with X ~ Pareto(shape 1.5,
  minimum 1), clipped to [a, b]. About 60% of clients land below 2a, 9% above 5a.
- slow-fraction(p, factor): latencies from U(a, b), then a random fraction p of the
  clients (rounded) `factor` times slower (PACE: 30% at 5x; set a = b for two speeds).
- jitter j > 0: each task's latency is the client's times U(1 - j, 1 + j), drawn from
  (seed, task id) so that a replay is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedstale.common.config import RunConfig

PARETO_SHAPE = 1.5


@dataclass(frozen=True)
class LatencyProfile:
    base: np.ndarray
    jitter: float
    seed: int

    def task_latency(self, client: int, task_id: int) -> float:
        latency = float(self.base[client])
        if self.jitter > 0:
            rng = np.random.default_rng([self.seed, task_id, 0x1A7])
            latency *= float(rng.uniform(1 - self.jitter, 1 + self.jitter))
        return latency


def client_latencies(
    kind: str,
    num_clients: int,
    low: float,
    high: float,
    seed: int,
    *,
    slow_fraction: float = 0.3,
    slow_factor: float = 5.0,
) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x1A7E])
    if kind == "uniform":
        return rng.uniform(low, high, num_clients)
    if kind == "long-tail":
        return np.clip(low * (1.0 + rng.pareto(PARETO_SHAPE, num_clients)), low, high)
    if kind == "slow-fraction":
        base = rng.uniform(low, high, num_clients)
        slow = rng.permutation(num_clients)[: int(round(slow_fraction * num_clients))]
        base[slow] *= slow_factor
        return base
    raise ValueError(f"unknown latency profile '{kind}'")


def profile_for(run: RunConfig) -> LatencyProfile:
    """The latency profile a run config describes."""
    base = client_latencies(
        run.latency,
        run.num_clients,
        run.latency_min,
        run.latency_max,
        run.seed,
        slow_fraction=run.slow_fraction,
        slow_factor=run.slow_factor,
    )
    return LatencyProfile(base=base, jitter=run.latency_jitter, seed=run.seed)
