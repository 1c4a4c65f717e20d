"""The client-edge-cloud hierarchy shared by MAFSA (fedstale/strategies/mafsa.py) and HierFedAvg
(fedstale/strategies/hierfedavg.py): seeded edge groups, the dropout schedule (the same for both
rules at the same p), the edges' synchronous rounds and the edge aggregation (MAFSA
eq. 10-11, which with no returning client is the data-weighted FedAvg of the round).

Edges are logical parts of the server: each plans its own rounds (its online clients at
the round's start get its model), closes a round when all of them have answered or were
lost, and uploads after `mafsa-edge-rounds` rounds. A round in which none of the edge's
reachable clients is online closes at once with the edge model unchanged (it still counts).
The cloud step on an upload is the subclass's (`upload`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from fedstale.common.config import KebabModel, RuleSettings
from fedstale.common.schema import ARRAYS, RETURN_MODEL, STALE
from fedstale.strategies.base import (
    Assignment,
    InFlight,
    Outcome,
    Plan,
    Setup,
    Strategy,
    Topology,
    Update,
    View,
    update_record,
)

log = logging.getLogger("fedstale")


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


class HierarchyParams(KebabModel):
    """Keys of MAFSA and HierFedAvg."""

    mafsa_edges: int = Field(default=5, ge=1)
    mafsa_edge_rounds: int = Field(default=1, ge=1)
    mafsa_cloud_rule: Literal["delta", "mix"] = "delta"
    mafsa_edge_slowdown: str = ""
    mafsa_dropout_rate: float = Field(default=0.0, ge=0, lt=1)

    renamed: ClassVar[dict[str, str]] = {"dropout-rate": "mafsa-dropout-rate"}

    @field_validator("mafsa_edge_slowdown")
    @classmethod
    def _factors(cls, value: str) -> str:
        try:
            factors = [float(f) for f in value.split(",")] if value.strip() else []
        except ValueError:
            raise ValueError("give one factor per edge, e.g. '1,1,2,2,4'") from None
        if any(not f > 0 for f in factors):
            raise ValueError("every factor must be > 0, e.g. '1,1,2,2,4'")
        return value

    @property
    def slowdown(self) -> list[float]:
        text = self.mafsa_edge_slowdown
        return [float(f) for f in text.split(",")] if text.strip() else []


@dataclass
class Edge:
    """One edge server: its clients, model theta_k, the cloud model it last received
    (`base`), the round under way or next, and what that round awaits and has received."""

    clients: list[int]
    model: np.ndarray
    base: np.ndarray
    round: int = 0
    open: bool = False
    pending: set[int] = field(default_factory=set)
    received: list[tuple[Update, int]] = field(default_factory=list)  # (update, E_i)
    since_upload: int = 0
    waiting: bool = False  # uploaded; waits for the cloud (HierFedAvg)
    rounds_done: int = 0


class Hierarchy(Strategy[HierarchyParams], Topology):
    """Edges with synchronous rounds over a cloud model; the cloud step is the subclass's."""

    returns = RETURN_MODEL
    reuses_stale: ClassVar[bool] = False
    edges_key: ClassVar[str] = "mafsa-edges"
    kept: tuple[str, ...] = ("edges", "in_task", "dropped_at", "epochs", "cloud_updates")
    EMPTY_ROUNDS_PER_PLAN = 100  # bounds the draws when every reachable client is offline

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        groups = edge_groups(self.run.num_clients, self.params.mafsa_edges, self.run.seed)
        self.edges = [Edge(g, self.model.copy(), self.model.copy()) for g in groups]
        self.sizes = np.ones(self.run.num_clients)
        self.in_task: dict[int, tuple[int, int]] = {}  # client -> (edge, E_i) of its task
        self.dropped_at: dict[int, int] = {}  # t_i: the round a client went offline
        self.epochs: dict[int, int] = {}  # local epochs each client has run (lr decay)
        self.cloud_updates = 0

    @classmethod
    def check(cls, run: RuleSettings, params: HierarchyParams) -> None:
        if run.concurrency != run.num_clients:
            raise ValueError(
                f"{run.strategy} lets every online client of every edge train at once; "
                f"set concurrency = num-clients ({run.num_clients})"
            )
        if params.mafsa_edges > run.num_clients:
            raise ValueError(f"mafsa-edges ({params.mafsa_edges}) exceeds num-clients")
        slowdown = params.slowdown
        if slowdown and len(slowdown) != params.mafsa_edges:
            raise ValueError(
                f"mafsa-edge-slowdown has {len(slowdown)} factors for "
                f"{params.mafsa_edges} edges; give one per edge"
            )
        if run.prefetch:
            raise ValueError(f"{run.strategy} plans rounds per edge; set prefetch = false")

    # ------------------------------------------------------------ topology
    def edge_of(self, client: int) -> int:
        return next(k for k, edge in enumerate(self.edges) if client in edge.clients)

    def bind(self, setup: Setup) -> None:
        self.bind_client_sizes(setup.client_sizes)

    def bind_client_sizes(self, sizes: np.ndarray) -> None:
        """rho_k (eq. 12) and the lr schedule need each client's training-split size."""
        self.sizes = np.asarray(sizes, dtype=np.float64)

    def share(self, k: int) -> float:
        """rho_k: edge k's share of all training data."""
        return float(self.sizes[self.edges[k].clients].sum() / self.sizes.sum())

    def bind_edges(self, declared: dict[int, int]) -> None:
        """A SuperNode's `edge-id` puts its client on that edge (kept between rounds)."""
        for client, k in sorted(declared.items()):
            if not 0 <= k < len(self.edges):
                log.error(
                    "client %d's node names edge-id %d, outside 0..%d; it stays on edge %d",
                    client, k, len(self.edges) - 1, self.edge_of(client),
                )  # fmt: skip
                continue
            current = self.edge_of(client)
            if current != k:
                self.edges[current].clients.remove(client)
                self.edges[k].clients = sorted([*self.edges[k].clients, client])

    def latency_factors(self) -> np.ndarray | None:
        slowdown = self.params.slowdown
        if not slowdown:
            return None
        factors = np.ones(self.run.num_clients)
        for k, edge in enumerate(self.edges):
            factors[edge.clients] = slowdown[k]
        return factors

    # ------------------------------------------------------------ dispatch
    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        """Each edge without a round under way opens its next; rounds that closed at once
        (nobody online) are the plan's `closed` outcome."""
        idle = set(view.idle)
        assignments: list[Assignment] = []
        closed: list[Outcome] = []
        for k, edge in enumerate(self.edges):
            if not edge.open and not edge.waiting:
                assignments += self.open_round(k, idle, closed)
        return Plan(assignments, merged(closed) if closed else None)

    def open_round(self, k: int, idle: set[int], closed: list[Outcome]) -> list[Assignment]:
        """Edge k's next round: its online, reachable clients get the edge model. Rounds
        in which none is online close at once (into `closed`); no round opens while none
        is reachable."""
        edge = self.edges[k]
        reachable = [c for c in edge.clients if c in idle]
        if not reachable:
            return []
        for _ in range(self.EMPTY_ROUNDS_PER_PLAN):
            chosen = [
                c
                for c in reachable
                if online(c, edge.round, self.params.mafsa_dropout_rate, self.run.seed)
            ]
            for client in set(edge.clients) - set(chosen):
                self.dropped_at.setdefault(client, edge.round)
            if chosen:
                edge.open, edge.pending, edge.received = True, set(chosen), []
                return [self.assign_round(c, k) for c in chosen]
            closed.append(self.close_round(k))
            if edge.waiting:
                return []
        return []

    def offline_rounds(self, client: int, k: int) -> int:
        """E_i = t - t_i for a client back from an offline spell (0 otherwise)."""
        dropped = self.dropped_at.get(client)
        return 0 if dropped is None or not self.reuses_stale else self.edges[k].round - dropped

    def epochs_per_task(self, client: int) -> int:
        """HierFL's count of local epochs in one local update: one per finished pass over
        the client's data before T_c steps, and one at the end."""
        run = self.run
        if not run.local_steps:
            return run.local_epochs
        per_pass = max(1, math.ceil(self.sizes[client] / run.batch_size))
        return 1 + (run.local_steps - 1) // per_pass

    def assign_round(self, client: int, k: int) -> Assignment:
        offline = self.offline_rounds(client, k)
        self.in_task[client] = (k, offline)
        run, done = self.run, self.epochs.get(client, 0)
        per_task = self.epochs_per_task(client)
        models = {ARRAYS: self.edges[k].model}
        entries: dict[str, Any] = {}
        if offline:
            models[STALE] = self.last_local(client)
            entries = self.offline_entries(offline, done, per_task)
        lr = run.lr * run.lr_decay ** (done + offline * per_task)
        # a returning client sends its stale model back trained beside the edge model's
        returned = (STALE,) if offline else ()
        return Assignment(client, models, entries, {"lr": lr}, returned)

    def last_local(self, client: int) -> np.ndarray:
        return self.model

    def offline_entries(self, offline: int, epochs_done: int, per_task: int) -> dict[str, Any]:
        """The task entries that send a returning client's offline work (a rule that reuses
        stale models declares them)."""
        raise NotImplementedError(f"{self.name} reuses no stale model")

    # ------------------------------------------------------------ replies
    def on_update(self, update: Update, view: View) -> Outcome:
        k, offline = self.in_task.pop(update.client)
        edge = self.edges[k]
        edge.pending.discard(update.client)
        edge.received.append((update, offline))
        return Outcome() if edge.pending else self.close_round(k)

    def refuses_late(self, task: InFlight) -> str:
        return "its edge round counted the client as dropped"

    def on_task_lost(self, client: int) -> Outcome | None:
        """A lost task is that client's drop for the round; the edge does not wait for it."""
        k, _ = self.in_task.pop(client, (-1, 0))
        if k < 0:
            return None
        edge = self.edges[k]
        edge.pending.discard(client)
        self.dropped_at.setdefault(client, edge.round)
        return None if edge.pending or not edge.open else self.close_round(k)

    def close_round(self, k: int) -> Outcome:
        """Eq. 10-11 over the round's replies, then the upload when T_e rounds are done."""
        edge = self.edges[k]
        records = []
        if edge.received:
            updates = [u for u, _ in edge.received]
            offline = [e for _, e in edge.received]
            examples = [u.num_examples for u in updates]
            edge.model, alphas, beta = edge_aggregate(
                [u.vector for u in updates], [u.sets.get(STALE) for u in updates], examples, offline
            )
            total = sum(examples)
            for update, e, alpha in zip(updates, offline, alphas, strict=True):
                records.append(
                    update_record(
                        update,
                        update.num_examples / total,
                        edge=k,
                        round=edge.round,
                        E=e,
                        alpha=alpha,
                        beta=beta,
                    )
                )
                self.returned(update, e)
        edge.open, edge.pending, edge.received = False, set(), []
        edge.round += 1
        edge.rounds_done += 1
        edge.since_upload += 1
        changed = False
        if edge.since_upload >= self.params.mafsa_edge_rounds:
            edge.since_upload = 0
            changed = self.upload(k)
        return Outcome(changed=changed, records=records)

    def returned(self, update: Update, offline: int) -> None:
        """The client's round is done: back online, its epochs (offline ones too) counted."""
        client = update.client
        self.dropped_at.pop(client, None)
        per_task = self.epochs_per_task(client)
        self.epochs[client] = self.epochs.get(client, 0) + (offline + 1) * per_task

    def upload(self, k: int) -> bool:
        """Edge k's model reaches the cloud; True when the cloud model changed."""
        raise NotImplementedError

    # ------------------------------------------------------------ results, checkpoints
    def summary(self) -> dict[str, Any]:
        return {
            "edge_rounds": [edge.rounds_done for edge in self.edges],
            "cloud_updates": self.cloud_updates,
        }


def merged(outcomes: list[Outcome]) -> Outcome:
    """Several rounds' outcomes as one: changed if any changed, their records in order."""
    records = [record for outcome in outcomes for record in outcome.records]
    return Outcome(changed=any(o.changed for o in outcomes), records=records)
