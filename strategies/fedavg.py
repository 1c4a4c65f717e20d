"""FedAvg (McMahan et al. 2017), the synchronous baseline.

A round dispatches C clients, waits for all of them, then w = sum_i n_i w_i / sum_i n_i.
On the virtual clock a round lasts as long as its slowest sampled client. A lost task is
replaced by a fresh dispatch so that every round still closes with C updates.
"""

from __future__ import annotations

import numpy as np

from common.schema import RETURN_MODEL
from strategies.base import Outcome, Strategy, Update, update_record


class FedAvg(Strategy):
    name = "fedavg"
    returns = RETURN_MODEL

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.round_size = self.run.concurrency
        self.dispatched = 0
        self.received: list[Update] = []

    def may_dispatch(self) -> bool:
        return self.dispatched < self.round_size

    def on_dispatch(self, client: int) -> None:
        self.dispatched += 1

    def on_task_lost(self, client: int) -> None:
        self.dispatched -= 1

    def on_update(self, update: Update) -> Outcome:
        self.received.append(update)
        if len(self.received) < self.round_size:
            return Outcome()
        counts = np.array([u.num_examples for u in self.received], dtype=np.float64)
        weights = counts / counts.sum()
        models = np.stack([u.vector for u in self.received]).astype(np.float64)
        self.model = (weights @ models).astype(np.float32)
        records = [update_record(u, w) for u, w in zip(self.received, weights, strict=True)]
        self.received, self.dispatched = [], 0
        return Outcome(changed=True, records=records)
