"""FedAsync (Xie et al. 2019): mix every arriving model into the global one.

alpha_t = alpha * s(tau); w <- (1 - alpha_t) w + alpha_t w_i, with s one of the staleness
functions of fedstale/strategies/staleness.py (constant, poly, hinge, exponential).
FLGo defaults: alpha 0.6, poly a 0.5, hinge a 10 b 6; clients add the proximal term
mu/2 ||w - w_start||^2 with mu 0.005.

Bounded staleness (option, off by default): with `fedasync-max-staleness` S > 0, a task
still in flight once the model is more than S versions past its base is superseded and its
client restarts from the current model (the paper's analysis assumes tau <= S); its late
reply is discarded.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fedstale.common.config import KebabModel
from fedstale.common.schema import RETURN_MODEL
from fedstale.strategies.base import (
    Assignment,
    InFlight,
    Outcome,
    Strategy,
    Update,
    View,
    update_record,
)
from fedstale.strategies.privacy import LINEAR, Release, one
from fedstale.strategies.rule import Rule
from fedstale.strategies.staleness import Kind, Staleness


class FedAsyncParams(KebabModel):
    fedasync_alpha: float = Field(default=0.6, gt=0, le=1)
    fedasync_staleness: Kind = "poly"
    fedasync_poly_a: float = Field(default=0.5, ge=0)
    fedasync_hinge_a: float = Field(default=10.0, ge=0)
    fedasync_hinge_b: float = Field(default=6.0, ge=0)
    fedasync_exp_a: float = Field(default=0.5, ge=0)
    fedasync_mu: float = Field(default=0.005, ge=0)
    fedasync_max_staleness: int = Field(default=0, ge=0)


def staleness_function(params: FedAsyncParams) -> Staleness:
    kind = params.fedasync_staleness
    if kind == "hinge":
        return Staleness(kind, params.fedasync_hinge_a, params.fedasync_hinge_b)
    a = params.fedasync_exp_a if kind == "exponential" else params.fedasync_poly_a
    return Staleness(kind, a)


class FedAsync(Strategy[FedAsyncParams]):
    name = "fedasync"
    returns = RETURN_MODEL

    def assign(self, client: int, view: View) -> Assignment:
        assignment = super().assign(client, view)
        assignment.settings["proximal_mu"] = self.proximal_mu(client)
        return assignment

    def proximal_mu(self, client: int) -> float:
        return self.params.fedasync_mu

    def mixing_weight(self, staleness: int) -> float:
        return self.params.fedasync_alpha * staleness_function(self.params)(staleness)

    def on_update(self, update: Update, view: View) -> Outcome:
        alpha_t = self.mixing_weight(update.staleness)
        mixed = (1.0 - alpha_t) * self.model.astype(np.float64) + alpha_t * update.vector
        self.model = mixed.astype(np.float32)
        outcome = Outcome(changed=True, records=[update_record(update, alpha_t)])
        bound = self.params.fedasync_max_staleness
        if bound:
            # After this update the model is at view.version + 1.
            stale = [t for t in view.in_flight if view.version + 1 - t.base_version > bound]
            outcome.supersede = [t.task_id for t in stale]
            outcome.dispatch = [self.assign(t.client, view) for t in stale]
        return outcome

    def refuses_late(self, task: InFlight) -> str:
        bound = self.params.fedasync_max_staleness
        if bound and task.staleness > bound:
            return f"staleness {task.staleness} is past fedasync-max-staleness {bound}"
        return ""


RULES = (
    Rule(
        FedAsync,
        library="FedAsync",
        about="""FedAsync (Xie et al. 2019): every update is mixed in on arrival,
    w <- (1 - a_t) w + a_t w_i with a_t = fedasync_alpha * s(staleness).""",
        dp=Release(LINEAR, one),  # the step a_t (w_start + d_i - w): S = a_t C
    ),
)
