"""What the engine scores and how: the global model on the test set, or one model per
client on that client's own held-out split (mean and std over clients).

Per-client scores come from the server itself where the federation is simulated (Flower
simulation, in-process: every split can be rebuilt from the seed). On a real deployment
they come from the clients (reports.py): each scores the model it was sent before it
trains and reports it in its train reply; only clients without such a score in the last
interval get an `evaluate` message. Such an evaluation is written once every client it
asked has answered, failed, or run out of time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from fedstale.common.config import RunConfig
from fedstale.common.layout import ParamLayout
from fedstale.server_app.clock import Task
from fedstale.server_app.nodes import Nodes
from fedstale.server_app.reports import ClientReports, Pending
from fedstale.server_app.scored import ClientScorer, Evaluation, Evaluator, over_clients
from fedstale.server_app.transport import Transport
from fedstale.strategies.base import EVAL_PER_CLIENT, Strategy, evaluates, model_of


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
        self.evaluator = evaluator
        self.scorer = scorer
        target = evaluates(strategy) if run.eval_target == "auto" else run.eval_target
        self.per_client = target == EVAL_PER_CLIENT
        where = run.eval_where
        if where == "auto":
            where = "server" if transport.simulated else "clients"
        self.by_message = self.per_client and where == "clients"
        if self.per_client and not self.by_message and scorer is None:
            raise ValueError("per-client evaluation on the server needs a client scorer")
        self.reports = ClientReports(run, strategy, transport, layout) if self.by_message else None
        self.done: list[Evaluation] = []
        self.requests = 0
        self.target_hit = False
        self.time_to_target: float | None = None
        self.on_result: Callable[[Evaluation], None] = lambda evaluation: None

    @property
    def pending(self) -> list[Pending]:
        return self.reports.pending if self.reports else []

    @property
    def latest(self) -> Evaluation | None:
        """The newest evaluation asked for, finished or not."""
        if self.pending:
            return self.pending[-1].evaluation
        return self.done[-1] if self.done else None

    def task_entries(self) -> dict[str, Any]:
        """What every train message carries for the evaluation (nothing but on a real
        deployment's per-client evaluation: the ask for the score of its model)."""
        return self.reports.task_entries() if self.reports else {}

    def take(self, task: Task, metrics: Mapping[str, Any], now: float) -> None:
        """A valid train reply came in at clock time `now`: keep the score it reports."""
        if self.reports:
            self.reports.take(task, metrics, now)

    def evaluate(
        self, evaluation: Evaluation, nodes: Nodes, busy: frozenset[int] = frozenset()
    ) -> None:
        """Score the models for `evaluation` (its accuracy and loss are filled in); `busy`:
        the clients with a task in flight."""
        self.requests += 1
        if not self.per_client:
            evaluation.accuracy, evaluation.loss = self.evaluator(self.strategy.model)
            self.finish(evaluation)
        elif self.reports is None:
            assert self.scorer is not None
            scores = [
                self.scorer(c, model_of(self.strategy, c)) for c in range(self.run.num_clients)
            ]
            self.finish(over_clients(evaluation, scores))
        else:
            self.reports.start(evaluation, nodes, busy)
            self.collect(busy)

    def collect(self, busy: frozenset[int] = frozenset()) -> None:
        """Write the per-client evaluations that are complete (`busy`: the clients with a
        task in flight, whose train replies may still bring a score)."""
        for pending in self.reports.collect(busy) if self.reports else []:
            self.finish(from_clients(pending))

    def finish(self, evaluation: Evaluation) -> None:
        self.done.append(evaluation)
        self.on_result(evaluation)
        target = self.run.target_accuracy
        if target and evaluation.accuracy >= target and not self.target_hit:
            self.target_hit = True
            self.time_to_target = evaluation.virtual_time

    def drain(self, poll: float) -> None:
        """Wait (each pending evaluation at most until its deadline) for the last evaluate
        replies; no more train replies come."""
        while self.pending:
            self.collect()
            if self.pending:
                time.sleep(poll)


def from_clients(pending: Pending) -> Evaluation:
    """An evaluation from the scores clients reported: mean and std over them, how many
    came from train replies, and the oldest model version among them."""
    scores = [pending.scores[c] for c in sorted(pending.scores)]
    evaluation = over_clients(pending.evaluation, [(s.accuracy, s.loss) for s in scores])
    evaluation.from_train_replies = sum(s.from_training for s in scores)
    evaluation.oldest_version = min((s.version for s in scores), default=evaluation.version)
    return evaluation
