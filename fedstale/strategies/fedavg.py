"""FedAvg (McMahan et al. 2017), the synchronous baseline.

A round dispatches C clients, waits for all of them, then w = sum_i n_i w_i / sum_i n_i.
The round barrier is the plan: nothing is dispatched while a round is open, except a
replacement for a lost task, so that every round still closes with C updates. On the
virtual clock a round lasts as long as its slowest sampled client.

Under differential privacy (`dp-clipping-norm` > 0) every update weighs 1/C, as Flower's
accounted FedAvg requires: a weight n_i / sum n_j moves when another client joins or
leaves, so no bound on one client's share of the release would hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedstale.common.schema import RETURN_MODEL
from fedstale.strategies.base import (
    InFlight,
    Outcome,
    Plan,
    Strategy,
    Update,
    View,
    pick_uniform,
    update_record,
)
from fedstale.strategies.privacy import LINEAR, Release, cohort
from fedstale.strategies.rule import Rule


class FedAvg(Strategy):
    name = "fedavg"
    returns = RETURN_MODEL
    kept = ("dispatched", "received")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.round_size = self.run.concurrency
        self.dispatched = 0
        self.received: list[Update] = []

    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        open_slots = min(view.capacity, self.round_size - self.dispatched)
        return Plan([self.assign(c, view) for c in pick_uniform(view.idle, open_slots, rng)])

    def on_dispatch(self, client: int) -> None:
        self.dispatched += 1

    def on_task_lost(self, client: int) -> Outcome | None:
        self.dispatched -= 1
        return None

    def refuses_late(self, task: InFlight) -> str:
        if task.staleness:
            return f"synchronous round of version {task.base_version} closed without it"
        return "synchronous round: a replacement task took its place"

    def on_update(self, update: Update, view: View) -> Outcome:
        self.received.append(update)
        if len(self.received) < self.round_size:
            return Outcome()
        counts = np.array([u.num_examples for u in self.received], dtype=np.float64)
        weights = np.full(len(counts), 1 / len(counts)) if self.run.clips else counts / counts.sum()
        models = np.stack([u.vector for u in self.received]).astype(np.float64)
        self.model = (weights @ models).astype(np.float32)
        records = [update_record(u, w) for u, w in zip(self.received, weights, strict=True)]
        self.received, self.dispatched = [], 0
        return Outcome(changed=True, records=records)


RULES = (
    Rule(
        FedAvg,
        library="FedAvg",
        about="""FedAvg (McMahan et al. 2017) on fedstale's engine: rounds of `concurrency`
    clients, w = sum n_i w_i / sum n_i; the synchronous baseline, with results folder and
    checkpoints.""",
        # uniform weights under DP: S = C / m; the round's count of tasks is the schedule's
        dp=Release(LINEAR, cohort, public=("dispatched",)),
    ),
)
