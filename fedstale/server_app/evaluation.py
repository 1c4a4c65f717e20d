"""What the engine scores and how: the global model on the test set, or one model per
client on that client's own held-out split (mean and std over clients).

Per-client scores come from the server itself where the federation is simulated (Flower
simulation, in-process: every split can be rebuilt from the seed), or from Flower
`evaluate` messages on a real deployment, collected while training goes on; such an
evaluation is written once every client has answered, failed, or run out of time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedstale.common.config import RunConfig
from fedstale.common.models import ParamLayout
from fedstale.common.schema import (
    MSG_EVALUATE,
    InvalidReply,
    ReplyKeys,
    TaskKeys,
    parse_eval_metrics,
)
from fedstale.server_app.nodes import Nodes
from fedstale.server_app.transport import Reply, SendRefused, Transport
from fedstale.strategies.base import EVAL_PER_CLIENT, Strategy

log = logging.getLogger("fedstale")
Evaluator = Callable[[np.ndarray], tuple[float, float]]  # global model -> (accuracy, loss)
ClientScorer = Callable[[int, np.ndarray], tuple[float, float]]  # client, model -> same


@dataclass
class Evaluation:
    virtual_time: float
    wall_time: float
    version: int
    accuracy: float
    loss: float
    updates: int
    accuracy_std: float | None = None  # per-client evaluation only
    loss_std: float | None = None
    clients: int | None = None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Pending:
    """A per-client evaluation waiting for evaluate replies."""

    evaluation: Evaluation
    waiting: dict[str, int]  # message id -> client
    deadline: float
    scores: dict[int, tuple[float, float]] = field(default_factory=dict)


def over_clients(evaluation: Evaluation, scores: list[tuple[float, float]]) -> Evaluation:
    """Fill in the unweighted mean and the population std over clients."""
    accuracies = np.array([a for a, _ in scores], dtype=np.float64)
    losses = np.array([loss for _, loss in scores], dtype=np.float64)
    evaluation.accuracy = float(accuracies.mean()) if scores else math.nan
    evaluation.loss = float(losses.mean()) if scores else math.nan
    evaluation.accuracy_std = float(accuracies.std()) if scores else math.nan
    evaluation.loss_std = float(losses.std()) if scores else math.nan
    evaluation.clients = len(scores)
    return evaluation


class Scoreboard:
    """Runs evaluations as the engine asks and keeps their results in time order."""

    def __init__(
        self,
        run: RunConfig,
        strategy: Strategy,
        transport: Transport,
        layout: ParamLayout,
        evaluator: Evaluator,
        scorer: ClientScorer | None,
    ) -> None:
        self.run = run
        self.strategy = strategy
        self.transport = transport
        self.layout = layout
        self.evaluator = evaluator
        self.scorer = scorer
        target = strategy.evaluates if run.eval_target == "auto" else run.eval_target
        self.per_client = target == EVAL_PER_CLIENT
        where = run.eval_where
        if where == "auto":
            where = "server" if transport.simulated else "clients"
        self.by_message = self.per_client and where == "clients"
        if self.per_client and not self.by_message and scorer is None:
            raise ValueError("per-client evaluation on the server needs a client scorer")
        self.done: list[Evaluation] = []
        self.pending: list[Pending] = []
        self.requests = 0
        self.target_hit = False
        self.time_to_target: float | None = None
        self.on_result: Callable[[Evaluation], None] = lambda evaluation: None

    @property
    def latest(self) -> Evaluation | None:
        """The newest evaluation asked for, finished or not."""
        if self.pending:
            return self.pending[-1].evaluation
        return self.done[-1] if self.done else None

    def evaluate(self, evaluation: Evaluation, nodes: Nodes) -> None:
        """Score the models for `evaluation` (its accuracy and loss are filled in)."""
        self.requests += 1
        if not self.per_client:
            evaluation.accuracy, evaluation.loss = self.evaluator(self.strategy.model)
            self.finish(evaluation)
        elif not self.by_message:
            assert self.scorer is not None
            scores = [
                self.scorer(c, self.strategy.model_of(c)) for c in range(self.run.num_clients)
            ]
            self.finish(over_clients(evaluation, scores))
        else:
            self.send(evaluation, nodes)

    def send(self, evaluation: Evaluation, nodes: Nodes) -> None:
        waiting = {}
        for client in nodes.clients:
            arrays = self.layout.unflatten(self.strategy.model_of(client))
            config = {TaskKeys.TASK_ID: self.requests}
            try:
                waiting[
                    self.transport.send(nodes.node_of[client], MSG_EVALUATE, config, arrays)
                ] = client
            except SendRefused as err:
                log.warning("evaluation of client %d not sent: %s", client, err)
        timeout = self.run.task_timeout or self.run.task_ttl
        self.pending.append(Pending(evaluation, waiting, time.monotonic() + timeout))
        self.collect()

    def collect(self) -> None:
        """Take the evaluate replies that are in; write the evaluations that are complete."""
        wanted = [m for p in self.pending for m in p.waiting]
        replies = {r.msg_id: r for r in self.transport.receive(wanted)} if wanted else {}
        now = time.monotonic()
        for pending in self.pending:
            for msg_id in [m for m in pending.waiting if m in replies]:
                client = pending.waiting.pop(msg_id)
                score = self.check(client, replies[msg_id])
                if score is not None:
                    pending.scores[client] = score
            if pending.waiting and now > pending.deadline:
                log.warning(
                    "evaluation at t=%.0f: %d clients did not answer in time; scored without them",
                    pending.evaluation.virtual_time,
                    len(pending.waiting),
                )
                pending.waiting.clear()
        while self.pending and not self.pending[0].waiting:
            first = self.pending.pop(0)
            scores = [first.scores[c] for c in sorted(first.scores)]
            self.finish(over_clients(first.evaluation, scores))

    @staticmethod
    def check(client: int, reply: Reply) -> tuple[float, float] | None:
        reason = reply.invalid or (
            f"error reply (code {reply.error_code}): {reply.error}"
            if reply.error_code is not None
            else ""
        )
        if not reason:
            try:
                metrics = parse_eval_metrics(reply.metrics)
                if metrics[ReplyKeys.PARTITION_ID] != client:
                    raise InvalidReply(f"reply claims client {metrics[ReplyKeys.PARTITION_ID]}")
                return metrics[ReplyKeys.ACCURACY], metrics[ReplyKeys.LOSS]
            except InvalidReply as err:
                reason = str(err)
        log.warning("evaluation of client %d rejected: %s", client, reason)
        return None

    def finish(self, evaluation: Evaluation) -> None:
        self.done.append(evaluation)
        self.on_result(evaluation)
        target = self.run.target_accuracy
        if target and evaluation.accuracy >= target and not self.target_hit:
            self.target_hit = True
            self.time_to_target = evaluation.virtual_time

    def drain(self, poll: float) -> None:
        """Wait (each pending evaluation at most until its deadline) for the last replies."""
        while self.pending:
            self.collect()
            if self.pending:
                time.sleep(poll)
