"""Local-only training: the personalised rules' no-collaboration baseline (docs/algorithms.md,
PACE section).

The server keeps one model per client, initially the initial model. A task for client c
starts from c's own model; its reply replaces that model and nothing else. Staleness plays
no part: nothing a client receives ever came from another. Evaluation is per client, each
client's own model on its own split, as PACE's. The global model (saved, and scored only
under `eval-target = global`) is the mean of the clients' models.
"""

from __future__ import annotations

import numpy as np

from fedstale.common.config import RuleSettings
from fedstale.common.schema import ARRAYS, RETURN_MODEL
from fedstale.strategies.base import (
    Assignment,
    NoParams,
    Outcome,
    PerClientModels,
    Strategy,
    Update,
    View,
    mean_model,
    update_record,
)
from fedstale.strategies.rule import Rule


class LocalOnly(Strategy[NoParams], PerClientModels):
    name = "local-only"
    returns = RETURN_MODEL
    kept = ("own",)

    def __init__(self, run: RuleSettings, params: NoParams, initial: np.ndarray) -> None:
        super().__init__(run, params, initial)
        self.own = np.tile(self.model, (run.num_clients, 1))

    def assign(self, client: int, view: View) -> Assignment:
        assignment = super().assign(client, view)
        assignment.models[ARRAYS] = self.own[client]
        return assignment

    def model_of(self, client: int) -> np.ndarray:
        return self.own[client]

    def on_update(self, update: Update, view: View) -> Outcome:
        self.own[update.client] = update.vector
        self.model = mean_model(self.own)
        return Outcome(changed=True, records=[update_record(update, 1.0)])


RULES = (Rule(LocalOnly, no_dp="each client keeps its own model; nothing is aggregated"),)
