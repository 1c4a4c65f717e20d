"""MAFSA (papers/mafsa.txt, Algorithms 1-3, eq. 9-12): client-edge-cloud FL, synchronous at
each edge, asynchronous at the cloud, the stale work of clients that dropped out reused.
The exact rule is ALGORITHMS.md's MAFSA section.

This file holds the rule's math as plain functions over flat vectors: the seeded edge
groups and dropout schedule (the same for MAFSA and HierFedAvg at the same p), the staleness
weights (eq. 10-11), the edge aggregation and the two cloud steps (eq. 12); each is
unit-tested against values worked by hand (tests/test_mafsa.py).
"""

from __future__ import annotations

import math

import numpy as np

CLOUD_RULES = ("delta", "mix")


def edge_groups(num_clients: int, edges: int, seed: int) -> list[list[int]]:
    """Clients split into `edges` equal groups (the first groups one larger when the split is
    uneven) by a seeded permutation."""
    order = np.random.default_rng([seed, 0xED6E]).permutation(num_clients)
    return [sorted(int(c) for c in part) for part in np.array_split(order, edges)]


def online(client: int, edge_round: int, p: float, seed: int) -> bool:
    """Whether `client` is online at the start of its edge's round `edge_round`: probability
    1 - p, drawn from (seed, client, round) alone, so every rule sees the same schedule."""
    if p <= 0:
        return True
    return bool(np.random.default_rng([seed, client, edge_round, 0xD809]).random() >= p)


def beta_for(offline_rounds: list[int]) -> float:
    """beta = ln(1 + E_avg / 2) / E_avg, E_avg the mean of the round's E_i > 0 (0 if none)."""
    returning = [e for e in offline_rounds if e > 0]
    if not returning:
        return 0.0
    mean = sum(returning) / len(returning)
    return math.log(1 + mean / 2) / mean


def alpha_for(offline: int, beta: float) -> float:
    """alpha_i = exp(-beta E_i): the fresh model's share (1 when the client never left)."""
    return 1.0 if offline == 0 else math.exp(-beta * offline)


def edge_aggregate(
    fresh: list[np.ndarray], stale: list[np.ndarray | None], examples: list[int], offline: list[int]
) -> tuple[np.ndarray, list[float], float]:
    """Eq. 10-11: theta_k = sum n_i (alpha_i w_fresh_i + (1 - alpha_i) w_stale_i) / sum n_i;
    returns theta_k, the alphas and beta. A client with E_i = 0 has no stale model."""
    beta = beta_for(offline)
    alphas = [alpha_for(e, beta) for e in offline]
    total = np.zeros_like(fresh[0], dtype=np.float64)
    for w_fresh, w_stale, n, a in zip(fresh, stale, examples, alphas, strict=True):
        blended = w_fresh.astype(np.float64)
        if a < 1.0:
            assert w_stale is not None, "a returning client must bring its stale model"
            blended = a * blended + (1 - a) * w_stale.astype(np.float64)
        total += n * blended
    return (total / sum(examples)).astype(np.float32), alphas, beta


def cloud_step(
    model: np.ndarray, theta: np.ndarray, base: np.ndarray, share: float, rule: str
) -> np.ndarray:
    """Eq. 12 when edge k uploads: `delta` w + rho_k (theta_k - w_base_k) (w_base_k the cloud
    model the edge last received), `mix` (1 - rho_k) w + rho_k theta_k."""
    w = model.astype(np.float64)
    if rule == "delta":
        return (w + share * (theta.astype(np.float64) - base)).astype(np.float32)
    return ((1 - share) * w + share * theta.astype(np.float64)).astype(np.float32)
