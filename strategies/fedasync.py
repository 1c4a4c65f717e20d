"""FedAsync (Xie et al. 2019): mix every arriving model into the global one.

alpha_t = alpha * s(tau); w <- (1 - alpha_t) w + alpha_t w_i, with s one of
constant: 1; poly: (tau + 1)^-a; hinge: 1 if tau <= b else 1 / (a (tau - b) + 1).
FLGo defaults: alpha 0.6, poly a 0.5, hinge a 10 b 6; clients add the proximal term
mu/2 ||w - w_start||^2 with mu 0.005.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from common.config import KebabModel
from common.schema import RETURN_MODEL
from strategies.base import Outcome, Strategy, Update, update_record


class FedAsyncParams(KebabModel):
    fedasync_alpha: float = Field(0.6, gt=0, le=1)
    fedasync_staleness: Literal["constant", "poly", "hinge"] = "poly"
    fedasync_poly_a: float = Field(0.5, ge=0)
    fedasync_hinge_a: float = Field(10.0, ge=0)
    fedasync_hinge_b: float = Field(6.0, ge=0)
    fedasync_mu: float = Field(0.005, ge=0)


def staleness_factor(tau: int, kind: str, poly_a: float, hinge_a: float, hinge_b: float) -> float:
    if kind == "constant":
        return 1.0
    if kind == "poly":
        return float((tau + 1.0) ** -poly_a)
    if kind == "hinge":
        return 1.0 if tau <= hinge_b else 1.0 / (hinge_a * (tau - hinge_b) + 1.0)
    raise ValueError(f"unknown staleness function '{kind}'")


class FedAsync(Strategy):
    name = "fedasync"
    returns = RETURN_MODEL
    Params = FedAsyncParams
    params: FedAsyncParams

    def proximal_mu(self, client: int) -> float:
        return self.params.fedasync_mu

    def mixing_weight(self, staleness: int) -> float:
        p = self.params
        factor = staleness_factor(
            staleness,
            p.fedasync_staleness,
            p.fedasync_poly_a,
            p.fedasync_hinge_a,
            p.fedasync_hinge_b,
        )
        return p.fedasync_alpha * factor

    def on_update(self, update: Update) -> Outcome:
        alpha_t = self.mixing_weight(update.staleness)
        mixed = (1.0 - alpha_t) * self.model.astype(np.float64) + alpha_t * update.vector
        self.model = mixed.astype(np.float32)
        return Outcome(changed=True, records=[update_record(update, alpha_t)])
