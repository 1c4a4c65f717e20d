"""FedBuff (Nguyen et al. 2022): buffered asynchronous aggregation.

Deltas collect in a buffer of K; when it is full,
w <- w + eta_g * (1/K) * sum_i (1 + tau_i)^-0.5 * delta_i (weights not renormalised).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import Field

from fedstale.strategies.base import Outcome, Strategy, Update, View, step_scale, update_record
from fedstale.strategies.buffer import Buffer, BufferParams
from fedstale.strategies.privacy import LINEAR, Release
from fedstale.strategies.rule import Rule
from fedstale.strategies.staleness import Staleness

DISCOUNT = Staleness("poly", 0.5)  # (1 + tau)^-0.5


class FedBuffParams(BufferParams):
    fedbuff_server_lr: float = Field(default=1.0, gt=0)


class FedBuff(Strategy[FedBuffParams]):
    name = "fedbuff"
    kept = ("buffer",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer: Buffer[Update] = Buffer(self.params.buffer_size)

    def weight(self, staleness: int, version: int) -> float:
        size = self.params.buffer_size
        eta = self.params.fedbuff_server_lr * step_scale(self.run, version)
        return eta / size * DISCOUNT(staleness)

    def on_update(self, update: Update, view: View) -> Outcome:
        batch = self.buffer.add(update)
        if batch is None:
            return Outcome()
        weights = np.array([self.weight(u.staleness, view.version) for u in batch])
        step = weights @ np.stack([u.vector for u in batch]).astype(np.float64)
        self.model = (self.model + step).astype(np.float32)
        records = [update_record(u, w) for u, w in zip(batch, weights, strict=True)]
        return Outcome(changed=True, records=records)


RULES = (
    Rule(
        FedBuff,
        library="FedBuff",
        about="""FedBuff (Nguyen et al. 2022): deltas buffered K at a time (`buffer_size`),
    each discounted by (1 + staleness)^-0.5.""",
        dp=Release(LINEAR),  # S = eta_g C / K: the weights follow staleness, not the deltas
    ),
)
