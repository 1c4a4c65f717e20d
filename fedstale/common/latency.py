"""Client latency profiles in virtual time units (FLGo: 86,400 units per virtual day).

Fixed per client, whatever the task:
- uniform(a, b): each client's latency drawn once from U(a, b) (FLGo's UNI-a-b).
- long-tail(a, b): most clients fast, a few very slow: a * X with X ~ Pareto(shape 1.5,
  minimum 1), clipped to [a, b]. About 60% of clients land below 2a, 9% above 5a.
- slow-fraction(p, factor): latencies from U(a, b), then a random fraction p of the
  clients (rounded) `factor` times slower (PACE: 30% at 5x; set a = b for two speeds).

Proportional to the task's local work (the PACE authors' simulator: measured training
time times a device factor):
- proportional: steps x step-time x device factor + network, where steps is what the task
  trains (local-steps, or local-epochs x ceil(n_i / batch-size) for the client's n_i
  training samples: `training.step_count`) and the device factor is `slow-factor` for a
  random fraction `slow-fraction` of the clients, 1 for the rest.

Any profile: jitter j > 0 multiplies each task's latency by U(1 - j, 1 + j), drawn from
(seed, task id) so that a replay is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.schema import TaskSpec

PARETO_SHAPE = 1.5
PROPORTIONAL = "proportional"


@dataclass(frozen=True)
class LatencyProfile:
    """`base`: each client's latency (fixed profiles) or its time per local step
    (proportional, device factor included); `samples`: each client's training samples,
    set only for the proportional profile; `network`: time added to every task."""

    base: np.ndarray
    jitter: float
    seed: int
    samples: np.ndarray | None = None
    network: float = 0.0

    def task_latency(self, client: int, task_id: int, task: TaskSpec | None = None) -> float:
        latency = float(self.base[client])
        if self.samples is not None:
            if task is None:
                raise ValueError("a proportional latency needs the task's work")
            from fedstale.common.training import step_count  # torch: not for the launcher

            steps = step_count(
                int(self.samples[client]), task.local_epochs, task.batch_size, task.local_steps
            )
            latency = steps * latency + self.network
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
        base[slow_clients(rng, num_clients, slow_fraction)] *= slow_factor
        return base
    raise ValueError(f"unknown latency profile '{kind}'")


def slow_clients(rng: np.random.Generator, num_clients: int, fraction: float) -> np.ndarray:
    """A random `fraction` of the clients (rounded)."""
    return rng.permutation(num_clients)[: int(round(fraction * num_clients))]


def device_factors(num_clients: int, seed: int, fraction: float, factor: float) -> np.ndarray:
    """1 for every client but a random `fraction` of them, `factor` for those."""
    factors = np.ones(num_clients)
    factors[slow_clients(np.random.default_rng([seed, 0xDEF1]), num_clients, fraction)] = factor
    return factors


def profile_for(run: RunConfig, samples: np.ndarray | None = None) -> LatencyProfile:
    """The latency profile a run config describes; `samples` (each client's training
    samples) is needed by the proportional profile alone."""
    if run.latency == PROPORTIONAL:
        if samples is None:
            raise ConfigError(
                "latency=proportional needs each client's data size, which only fedstale's "
                "own app knows before a run; use latency=uniform, long-tail or slow-fraction"
            )
        factors = device_factors(run.num_clients, run.seed, run.slow_fraction, run.slow_factor)
        return LatencyProfile(
            base=run.latency_step_time * factors,
            jitter=run.latency_jitter,
            seed=run.seed,
            samples=np.asarray(samples, dtype=np.int64),
            network=run.latency_network,
        )
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
