"""FedFa (Xu et al., IJCAI 2024): fully asynchronous, a sliding window of client models.

The server updates at every arrival: push the received model into a window of the last K
(drop the oldest when full) and set w = mean(window).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from fedstale.common.schema import RETURN_MODEL
from fedstale.strategies.base import Outcome, Strategy, Update, View, update_record
from fedstale.strategies.buffer import BufferParams
from fedstale.strategies.rule import Rule


class FedFa(Strategy[BufferParams]):
    name = "fedfa"
    returns = RETURN_MODEL
    kept = ("window",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window: deque[np.ndarray] = deque(maxlen=self.params.buffer_size)

    def on_update(self, update: Update, view: View) -> Outcome:
        self.window.append(update.vector.astype(np.float32))
        self.model = np.mean(np.stack(self.window).astype(np.float64), axis=0).astype(np.float32)
        return Outcome(changed=True, records=[update_record(update, 1.0 / len(self.window))])


RULES = (
    Rule(
        FedFa,
        library="FedFa",
        about="""FedFa (Xu et al. 2024): a sliding window of the last K models, averaged on
    every arrival.""",
        no_dp="each model stays in the window for K releases",
    ),
)
