"""CA2FL (Wang et al. 2024): cached update calibration for buffered asynchronous FL.

State: the last delta h_i of every client (zero before its first), their mean h, and an
accumulator S. On arrival: S += delta_i - h_i; h_i = delta_i. After K arrivals:
v = h + S / K (at the first flush h = 0, so v = S / K), w <- w + eta_g v, then
h = sum_i h_i / N (never-seen clients count as zero), S and the count reset.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field

from fedstale.strategies.base import Outcome, Strategy, Update, View, step_scale, update_record
from fedstale.strategies.buffer import Buffer, BufferParams
from fedstale.strategies.rule import Rule


class CA2FLParams(BufferParams):
    ca2fl_server_lr: float = Field(default=1.0, gt=0)


class CA2FL(Strategy[CA2FLParams]):
    name = "ca2fl"
    kept = ("cache", "cache_mean", "accumulator", "arrived")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.model.size
        self.cache = np.zeros((self.run.num_clients, size), dtype=np.float32)
        self.cache_mean = np.zeros(size, dtype=np.float64)
        self.accumulator = np.zeros(size, dtype=np.float64)
        self.arrived: Buffer[Update] = Buffer(self.params.buffer_size)

    def on_update(self, update: Update, view: View) -> Outcome:
        self.accumulator += update.vector.astype(np.float64) - self.cache[update.client]
        self.cache[update.client] = update.vector
        batch = self.arrived.add(update)
        if batch is None:
            return Outcome()
        eta = self.params.ca2fl_server_lr * step_scale(self.run, view.version)
        step = self.cache_mean + self.accumulator / self.params.buffer_size
        self.model = (self.model + eta * step).astype(np.float32)
        self.cache_mean = self.cache.astype(np.float64).mean(axis=0)
        self.accumulator[:] = 0.0
        weight = eta / self.params.buffer_size
        return Outcome(changed=True, records=[update_record(u, weight) for u in batch])


RULES = (
    Rule(
        CA2FL,
        library="CA2FL",
        about="""CA2FL (Wang et al. 2024): FedBuff's buffer calibrated with each client's
    cached latest update.""",
        no_dp="every flush re-releases each client's cached delta, so one update enters "
        "many releases",
    ),
)
