"""MAFSA (Multi-level Asynchronous FL with Stale-model reuse; Algorithms 1-3, eq. 9-12):
client-edge-cloud FL, synchronous at each edge, asynchronous at the cloud, the stale work of
clients that dropped out reused (docs/algorithms.md, MAFSA).

The edges' rounds, dropout schedule and edge aggregation are fedstale/strategies/hierarchy.py's;
MAFSA adds the stale models (a returning client trains its last local model through the
rounds it missed: `StaleTraining`, the rule's client half) and the asynchronous cloud:
each edge upload moves the cloud model at once (eq. 12). Each function is unit-tested
against values worked by hand (tests/test_mafsa.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedstale.common.schema import STALE, keys_of
from fedstale.strategies.base import Update
from fedstale.strategies.client import ClientRule, LocalTask
from fedstale.strategies.hierarchy import Hierarchy
from fedstale.strategies.rule import Rule

CLOUD_RULES = ("delta", "mix")


def cloud_step(
    model: np.ndarray, theta: np.ndarray, base: np.ndarray, share: float, rule: str
) -> np.ndarray:
    """Eq. 12 when edge k uploads: `delta` w + rho_k (theta_k - w_base_k) (w_base_k the cloud
    model the edge last received), `mix` (1 - rho_k) w + rho_k theta_k."""
    w = model.astype(np.float64)
    if rule == "delta":
        return (w + share * (theta.astype(np.float64) - base)).astype(np.float32)
    return ((1 - share) * w + share * theta.astype(np.float64)).astype(np.float32)


# ---------------------------------------------------------------- the client half


class MAFSAKeys:
    """What MAFSA adds to a returning client's task config (its stale model goes as the
    named array set `stale`, and comes back under the same name)."""

    OFFLINE = "mafsa-offline"  # E_i, the offline rounds to train the stale model through
    STALE_LR = "mafsa-stale-lr"  # the lr of the first offline round
    LR_STEP = "mafsa-lr-step"  # the lr factor from one offline round to the next


def stale_schedule(extra: Mapping[str, Any], seed: int) -> list[tuple[float, int]]:
    """(lr, seed) of each of the E_i offline rounds a returning client trains its stale
    model through (Alg. 2): lr = mafsa-stale-lr * mafsa-lr-step^round, seed = the task's
    seed + 1 + round; none for a task without offline rounds. StaleTraining and
    fedstale.mafsa_mod both train by it."""
    rounds = int(extra.get(MAFSAKeys.OFFLINE, 0))
    if rounds <= 0:
        return []
    lr, step = float(extra[MAFSAKeys.STALE_LR]), float(extra[MAFSAKeys.LR_STEP])
    return [(lr * step**offline_round, seed + 1 + offline_round) for offline_round in range(rounds)]


class StaleTraining(ClientRule):
    """MAFSA (Alg. 2): a client back from E_i offline rounds does the offline work lazily:
    its last local model (the task's `stale` set) trains E_i local updates, each as long
    as the fresh one, with the lr decaying per offline round (`stale_schedule`), and goes
    back beside the fresh model."""

    name = "mafsa-stale-training"
    in_cohorts = True  # the fresh model trains in the cohort, the offline rounds after it
    mod = "fedstale.client_app.mods:mafsa_mod()"

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        from fedstale.common.models import get_flat, set_flat  # torch: not for the registry

        schedule = stale_schedule(task.spec.extra, task.spec.seed)
        if not schedule:
            return
        set_flat(task.model, task.inputs[STALE])
        for lr, seed in schedule:
            task.train(lr, seed)
        task.outputs[STALE] = get_flat(task.model)


# ---------------------------------------------------------------- the server half


class MAFSA(Hierarchy):
    """Returning clients bring their offline work (eq. 9-11); each edge upload moves the
    cloud model at once (eq. 12, `mafsa-cloud-rule`) and the edge goes on from it."""

    name = "mafsa"
    reuses_stale = True
    client_rules = (StaleTraining(),)
    kept = (*Hierarchy.kept, "initial", "local")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial = self.model.copy()
        self.local: dict[int, np.ndarray] = {}  # each client's last local (fresh) model

    def last_local(self, client: int) -> np.ndarray:
        return self.local.get(client, self.initial)

    def offline_entries(self, offline: int, epochs_done: int, per_task: int) -> dict[str, Any]:
        run = self.run
        return {
            MAFSAKeys.OFFLINE: offline,
            MAFSAKeys.STALE_LR: run.lr * run.lr_decay**epochs_done,
            MAFSAKeys.LR_STEP: run.lr_decay**per_task,
        }

    def returned(self, update: Update, offline: int) -> None:
        super().returned(update, offline)
        self.local[update.client] = update.vector

    def upload(self, k: int) -> bool:
        edge = self.edges[k]
        self.model = cloud_step(
            self.model, edge.model, edge.base, self.share(k), self.params.mafsa_cloud_rule
        )
        edge.model, edge.base = self.model.copy(), self.model.copy()
        self.cloud_updates += 1
        return True


RULES = (
    Rule(
        MAFSA,
        library="MAFSA",
        about="""MAFSA (Algorithms 1-3): HierFedAvg's edges, the cloud moved at once by each
    edge upload, and the stale models of clients back from dropping out (`mafsa_dropout_rate`)
    reused. Needs fedstale.mafsa_mod() in the ClientApp. Client sizes are unknown here:
    rho_k, an edge's share of the data, is its share of the clients.""",
        wire=keys_of(MAFSAKeys),
        no_dp="edge models are re-released at every cloud step and stale client models "
        "reused (a hierarchy of releases not worked out)",
    ),
)
