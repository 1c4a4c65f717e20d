"""PACE (Liu et al., Algorithm 1, eq. 2, 5-11, 15, 16; docs/algorithms.md) and pFedGraph-Async.

Personalised, asynchronous collaboration-based FL. The server keeps a buffer model phi_j
for every client, the collaboration graph W (n x n, rows on the simplex, initially every
row p with p_j = n_j / sum n) and, per client, the sum of W_jk over the sequence pi_j of
clients that updated phi_j since j's own last arrival (row j only changes when j arrives,
and pi_j is reset then, so the running sum is exactly sum_{k in pi_j} W_jk).

On the arrival of client i's model theta_i, with tau_i the updates the server handled
since the task was dispatched:
1. phi_i = theta_i; pi_i = [].
2. Row i (eq. 2 / 15): W_i = Proj_simplex(p + (gamma / 2) cos(theta_i, phi_j)_j).
3. For every j != i (eq. 5, 10, 11): append i to pi_j, alpha_ij = W_ji / (W_jj + sum_{k in
   pi_j} W_jk) * (1 + tau_i)^-a, phi_j = alpha_ij theta_i + (1 - alpha_ij) phi_j; one
   vectorised pass over the stacked buffers.
4. Multicast (eq. 16): the clients in flight sorted by tau (largest first, ties lower id);
   G = the shortest prefix with sum tau^2 > Omega; if |G| <= pace-multicast-max, their tasks
   are superseded and each restarts from its phi now.
A task for client c starts from phi_c; client c's personalised model (evaluated on its own
split) is phi_c.

pFedGraph-Async (the paper's naive baseline): phi_i = theta_i, row i as above, a task for
c starts from sum_j W_cj phi_j; no blending, no decay, no multicast. `pace-pfedgraph-style =
authors` stores the aggregate instead, as the authors' pFedGraph does: after row i is
solved (against the stored aggregates of the others), phi_i = sum_j W_ij phi_j (phi_i =
theta_i in the sum) and a task for c starts from phi_c. `pace-ablation` (Fig. 5): naive |
buffer (blending without the staleness decay) | buffer-multicast (and multicast) | none
(full PACE, with the decay).

Clients (`CosineToStart` below): cross-entropy + lambda (1 - cos(w, w_start)), SGD with
momentum 0.9 and weight decay 1e-4. Memory on the server: n models and an n x n graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import numpy as np
from pydantic import Field

from fedstale.common.config import KebabModel, RuleSettings
from fedstale.common.schema import ARRAYS, RETURN_MODEL, keys_of
from fedstale.strategies.base import (
    Assignment,
    Outcome,
    PerClientModels,
    Plan,
    Setup,
    Strategy,
    Update,
    View,
    mean_model,
    pick_uniform,
    update_record,
)
from fedstale.strategies.client import ClientRule, LocalTask
from fedstale.strategies.rule import Rule
from fedstale.strategies.staleness import Staleness

if TYPE_CHECKING:  # torch where it is used: the registry loads without it
    import torch


class PACEParams(KebabModel):
    pace_gamma: float = Field(default=1.5, ge=0)
    pace_lambda: float = Field(default=0.01, ge=0)
    pace_a: float = Field(default=1.5, ge=0)
    pace_omega: float = Field(default=2500.0, gt=0)
    pace_multicast_max: int = Field(default=5, ge=1)
    pace_ablation: Literal["none", "naive", "buffer", "buffer-multicast"] = "none"
    pace_dispatch: Literal["random", "same-client"] = "random"
    pace_momentum: float = Field(default=0.9, ge=0, lt=1)
    pace_weight_decay: float = Field(default=1e-4, ge=0)
    pace_pfedgraph_style: Literal["ours", "authors"] = "ours"

    renamed: ClassVar[dict[str, str]] = {"pfedgraph-style": "pace-pfedgraph-style"}


def project_to_simplex(values: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {w >= 0, sum w = 1} by sort and threshold (Duchi et al.
    2008, Fig. 1): rho = max{j : u_j - (sum_{r <= j} u_r - 1) / j > 0}, u sorted
    descending; w = max(v - (sum_{r <= rho} u_r - 1) / rho, 0)."""
    v = np.asarray(values, dtype=np.float64)
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    ranks = np.arange(1, len(v) + 1)
    rho = int(np.nonzero(u - cumulative / ranks > 0)[0][-1])
    return np.maximum(v - cumulative[rho] / (rho + 1), 0.0)


def cosine_to_rows(rows: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """cos(vector, rows_j) for every row, both norms clamped at >= 1e-12 (float32 products
    summed by BLAS; one pass over the rows, no copy)."""
    dots = (rows @ vector).astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
    own = float(np.sqrt(np.dot(vector.astype(np.float64), vector)))
    return dots / (np.maximum(norms, 1e-12) * max(own, 1e-12))


def multicast_group(stalenesses: list[tuple[int, int, int]], omega: float) -> list[int]:
    """Eq. 16: (tau, client, task) of the tasks in flight -> the task ids of the shortest
    prefix, by tau descending (ties: lower client id), whose sum of tau^2 exceeds omega;
    [] when even all of them do not."""
    total = 0.0
    group = []
    for tau, _, task in sorted(stalenesses, key=lambda s: (-s[0], s[1])):
        total += float(tau) ** 2
        group.append(task)
        if total > omega:
            return group
    return []


# ---------------------------------------------------------------- the client half


class PaceKeys:
    """What PACE and pFedGraph-Async add to the wire."""

    LAMBDA = "pace-lambda"  # task config: the weight of lambda (1 - cos(w, w_start))


class CosineToStart(ClientRule):
    """PACE and pFedGraph (eq. 4): the objective adds lambda (1 - cos(w, w_start)) over all
    parameters, w_start the model the task started from."""

    name = "cosine-to-start"
    in_cohorts = True  # its term has a batched form

    def before(self, task: LocalTask) -> None:
        weight = float(task.spec.extra.get(PaceKeys.LAMBDA, 0.0))
        if weight == 0:
            return
        import torch

        params = list(task.model.state_dict(keep_vars=True).values())  # the layout's order
        start = torch.from_numpy(task.start).to(params[0].device)
        task.loss_terms.append(CosineToStartTerm(weight, params, start))


@dataclass(frozen=True)
class CosineToStartTerm:
    """lambda (1 - cos(w, w_start)) (eq. 4): on the task's model (`params`, the layout's
    order), and as a cohort batches it (`flat`, fedstale/common/cohort.py BatchedTerm)."""

    weight: float
    params: list[torch.Tensor]
    start: torch.Tensor

    @staticmethod
    def flat(flat: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        import torch

        return 1.0 - torch.nn.functional.cosine_similarity(flat, start, 0, 1e-12)

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        import torch

        return self.weight * self.flat(torch.cat([p.reshape(-1) for p in self.params]), self.start)


# ---------------------------------------------------------------- the server half


class PACE(Strategy[PACEParams], PerClientModels):
    name = "pace"
    returns = RETURN_MODEL
    client_rules = (CosineToStart(),)
    kept = ("phi", "share", "graph", "sequence_weight", "sequence_length", "last_arrival")

    def __init__(self, run: RuleSettings, params: KebabModel, initial: np.ndarray) -> None:
        super().__init__(run, params, initial)
        n = run.num_clients
        self.phi = np.tile(self.model, (n, 1))
        self.share = np.full(n, 1.0 / n)  # p; bind_client_sizes sets the real shares
        self.graph = np.tile(self.share, (n, 1))
        self.sequence_weight = np.zeros(n)  # sum_{k in pi_j} W_jk
        self.sequence_length = np.zeros(n, dtype=np.int64)  # |pi_j|
        self.last_arrival: int | None = None
        self.decay = Staleness("poly", self.params.pace_a)

    @classmethod
    def check(cls, run: RuleSettings, params: PACEParams) -> None:
        if params.pace_pfedgraph_style == "authors" and cls.ablation_of(params) != "naive":
            raise ValueError(
                "pace-pfedgraph-style=authors is a form of the naive baseline: use "
                "strategy=pfedgraph-async (or pace-ablation=naive)"
            )

    @classmethod
    def ablation_of(cls, params: PACEParams) -> str:
        return params.pace_ablation

    @property
    def ablation(self) -> str:
        return self.ablation_of(self.params)

    @property
    def stores_aggregates(self) -> bool:
        """The authors' pFedGraph: phi_i is client i's aggregate, not its trained model."""
        return not self.blends and self.params.pace_pfedgraph_style == "authors"

    @property
    def blends(self) -> bool:
        return self.ablation != "naive"

    @property
    def multicasts(self) -> bool:
        return self.ablation in ("none", "buffer-multicast")

    @property
    def staleness_decay(self) -> bool:
        return self.ablation == "none"

    def bind(self, setup: Setup) -> None:
        self.bind_client_sizes(setup.client_sizes)

    def bind_client_sizes(self, sizes: np.ndarray) -> None:
        """p_j = n_j / sum n (the server knows every client's training-split size)."""
        self.share = np.asarray(sizes, dtype=np.float64) / float(np.sum(sizes))
        self.graph = np.tile(self.share, (len(self.share), 1))

    # ------------------------------------------------------------ dispatch
    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        if self.params.pace_dispatch == "same-client" and self.last_arrival in view.idle:
            first = self.last_arrival
            rest = [c for c in view.idle if c != first]
            chosen = [first, *pick_uniform(rest, view.capacity - 1, rng)]
        else:
            chosen = pick_uniform(view.idle, view.capacity, rng)
        return Plan([self.assign(c, view) for c in chosen])

    def assign(self, client: int, view: View) -> Assignment:
        params = self.params
        return Assignment(
            client,
            {ARRAYS: self.model_for(client)},
            {PaceKeys.LAMBDA: float(params.pace_lambda)},
            {"momentum": params.pace_momentum, "weight_decay": params.pace_weight_decay},
        )

    def model_for(self, client: int) -> np.ndarray:
        if self.blends or self.stores_aggregates:
            return self.phi[client]
        return self.aggregate(client)

    def aggregate(self, client: int) -> np.ndarray:
        """sum_j W_cj phi_j (float64 sums, stored as float32)."""
        mixed = self.graph[client] @ self.phi.astype(np.float64)
        return mixed.astype(np.float32)

    def model_of(self, client: int) -> np.ndarray:
        return self.model_for(client)

    # ------------------------------------------------------------ arrivals
    def solve_row(self, client: int, theta: np.ndarray) -> np.ndarray:
        """Eq. 2 / 15 for the arriving client against every buffer (itself included)."""
        similarity = cosine_to_rows(self.phi, theta)
        return project_to_simplex(self.share + self.params.pace_gamma / 2.0 * similarity)

    def blend(self, client: int, theta: np.ndarray, tau: int) -> np.ndarray:
        """Eq. 5, 10, 11 for every other buffer; returns alpha (0 for the arriving client)."""
        column = self.graph[:, client].copy()
        column[client] = 0.0
        self.sequence_weight += column
        self.sequence_length += 1
        self.sequence_length[client] = 0
        alpha = column / (np.diag(self.graph) + self.sequence_weight)
        if self.staleness_decay:
            alpha *= self.decay(tau)
        step = theta[None, :] - self.phi  # phi_j += alpha_ij (theta_i - phi_j), in float32
        step *= alpha.astype(np.float32)[:, None]
        self.phi += step
        return alpha

    def on_update(self, update: Update, view: View) -> Outcome:
        client, theta, tau = update.client, update.vector, update.arrivals
        self.last_arrival = client
        self.phi[client] = theta
        self.sequence_weight[client] = 0.0
        self.sequence_length[client] = 0
        self.graph[client] = self.solve_row(client, theta)
        if self.stores_aggregates:
            self.phi[client] = self.aggregate(client)
        alpha = self.blend(client, theta, tau) if self.blends else np.zeros(len(self.phi))
        self.model = mean_model(self.phi)
        outcome = Outcome(changed=True)
        group: list[int] = []
        if self.multicasts:
            # Each task still in flight has now seen one more arrival: this one.
            stalenesses = [(t.arrivals + 1, t.client, t.task_id) for t in view.in_flight]
            group = multicast_group(stalenesses, self.params.pace_omega)
            if len(group) > self.params.pace_multicast_max:
                group = []
            by_task = {t.task_id: t.client for t in view.in_flight}
            outcome.supersede = group
            outcome.dispatch = [self.assign(by_task[task], view) for task in group]
        others = alpha.sum() / max(len(alpha) - 1, 1)
        outcome.records = [
            update_record(
                update,
                float(self.graph[client, client]),
                tau=tau,
                mean_alpha=float(others),
                multicast=len(group),
            )
        ]
        return outcome


class PFedGraphAsync(PACE):
    """pFedGraph-Async: PACE with `pace-ablation = naive` whatever the key says."""

    name = "pfedgraph-async"

    @classmethod
    def ablation_of(cls, params: PACEParams) -> str:
        return "naive"


WIRE = keys_of(PaceKeys)
PER_CLIENT = "it keeps one model per client, each released to its client"
RULES = (
    Rule(PACE, wire=WIRE, no_dp=PER_CLIENT),
    Rule(PFedGraphAsync, wire=WIRE, no_dp=PER_CLIENT),
)
