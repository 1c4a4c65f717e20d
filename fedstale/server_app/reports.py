"""Per-client evaluation on a real deployment, without starving training.

Every train message asks its client to score the model it carries (the client's
personalised model as sent) on the client's own held-out split before it trains; the train
reply brings that score back and the server keeps each client's latest, with the version
and the time of the model it belongs to. An evaluation uses those scores: a client training
now counts with its latest whatever its age, and one training with no score yet (the first
evaluation: its first task is out) waits for the score its train reply brings (a reply with
none, or a task that ends without a reply, turns into an evaluate message). Only an idle
client whose last such score came in more than one `eval-interval` before the evaluation
(or that has none yet) gets a Flower `evaluate` message with its model as it is then; a
client whose evaluate message is still unanswered gets no second one: the later evaluation
waits for the same reply. An evaluation is complete once every client it waits for has
answered, failed, or run out of time; completed ones come out in the order they were asked
for. A failure that repeats (a dead node) is logged once per node and cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedstale.common.config import RunConfig
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import (
    MSG_EVALUATE,
    InvalidReply,
    ReplyKeys,
    ScoreKeys,
    TaskKeys,
    parse_eval_metrics,
    parse_start_score,
)
from fedstale.server_app.clock import Task
from fedstale.server_app.nodes import Nodes
from fedstale.server_app.once import OnceLog
from fedstale.server_app.scored import Evaluation
from fedstale.server_app.transport import Reply, SendRefused, Transport
from fedstale.strategies.base import Strategy, model_of

log = logging.getLogger("fedstale")


@dataclass(frozen=True)
class Score:
    """One client's score of one model, and which model: the global version and the clock
    time when it was sent (with a task, or with an evaluate message)."""

    accuracy: float
    loss: float
    version: int
    sent_at: float
    from_training: bool


@dataclass(frozen=True)
class Asked:
    """An evaluate message in flight."""

    client: int
    node: int
    version: int
    sent_at: float


@dataclass
class Pending:
    """An evaluation waiting for evaluate replies and for the train replies of clients
    training with no score yet; `scores` holds those it has, by client."""

    evaluation: Evaluation
    deadline: float
    waiting: dict[str, int] = field(default_factory=dict)  # message id -> client
    training: dict[int, int] = field(default_factory=dict)  # client -> node
    scores: dict[int, Score] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.waiting and not self.training


class ClientReports:
    def __init__(
        self, run: RunConfig, strategy: Strategy, transport: Transport, layout: ParamLayout
    ) -> None:
        self.run = run
        self.strategy = strategy
        self.transport = transport
        self.layout = layout
        self.reported: dict[int, tuple[Score, float]] = {}  # client -> (score, when it came)
        self.asked: dict[str, Asked] = {}
        self.entries: Callable[[int], dict[str, int]] = lambda client: {}  # Nodes.entries
        self.pending: list[Pending] = []
        self.messages = 0
        self.failures = OnceLog(log)
        self.bounded = run.metric == "accuracy"  # scores of any other metric: any finite

    @staticmethod
    def task_entries() -> dict[str, Any]:
        """What every train message carries: the ask for the score of its model."""
        return {ScoreKeys.ASK: 1}

    def take(self, task: Task, metrics: Mapping[str, Any], now: float) -> None:
        """Keep the score a valid train reply reports for the model its task carried (and
        give it to the evaluations waiting for it); a malformed one is logged and dropped
        (the update itself stands)."""
        kept = None
        try:
            score = parse_start_score(metrics, self.bounded)
        except InvalidReply as err:
            log.warning(
                "rejected score: node %d, task %d (client %d): %s",
                task.node,
                task.task_id,
                task.client,
                err,
            )
            score = None
        if score is not None:
            accuracy, loss = score
            kept = Score(accuracy, loss, task.version, task.dispatched_at, from_training=True)
            self.reported[task.client] = (kept, now)
        for pending in self.pending:
            if pending.training.pop(task.client, None) is None:
                continue
            if kept is not None:
                pending.scores[task.client] = kept
            else:  # a ClientApp that reports no score
                self.wait_for(pending, task.client, task.node)

    def fresh(self, client: int, at: float, busy: bool) -> Score | None:
        """The client's latest train-reply score if it came within one interval of `at`, or
        whatever its age while the client trains (its next reply brings a newer one; an
        evaluate message would only queue a second process behind its training)."""
        score, came = self.reported.get(client, (None, -float("inf")))
        return score if busy or at - came <= self.run.eval_interval else None

    def start(self, evaluation: Evaluation, nodes: Nodes, busy: frozenset[int]) -> None:
        """Begin an evaluation: the scores clients reported while training or recently,
        the train replies of those training with none yet, else evaluate messages (`busy`:
        the clients with a task in flight)."""
        timeout = self.run.task_timeout or self.run.task_ttl
        pending = Pending(evaluation, time.monotonic() + timeout)
        self.entries = nodes.entries
        for client in nodes.clients:
            score = self.fresh(client, evaluation.virtual_time, client in busy)
            if score is not None:
                pending.scores[client] = score
                continue
            if client in busy:
                pending.training[client] = nodes.node_of[client]
                continue
            self.wait_for(pending, client, nodes.node_of[client])
        self.pending.append(pending)

    def wait_for(self, pending: Pending, client: int, node: int) -> None:
        """Ask `client` for its score by an evaluate message (unless the SuperLink refuses)."""
        msg_id = self.ask(client, node, pending.evaluation)
        if msg_id is not None:
            pending.waiting[msg_id] = client

    def ask(self, client: int, node: int, evaluation: Evaluation) -> str | None:
        """The evaluate message whose reply scores `client` (one still unanswered, or a new
        one); None when the SuperLink refuses it."""
        for msg_id, asked in self.asked.items():
            if asked.client == client and asked.node == node:
                return msg_id
        arrays = self.layout.unflatten(model_of(self.strategy, client))
        self.messages += 1
        config = {TaskKeys.TASK_ID: self.messages, **self.entries(client)}
        try:
            msg_id = self.transport.send(node, MSG_EVALUATE, config, arrays)
        except SendRefused as err:
            self.failures.warning(
                (node, str(err)),
                "evaluation of client %d (node %d) not sent: %s",
                client,
                node,
                err,
            )
            return None
        self.asked[msg_id] = Asked(client, node, evaluation.version, evaluation.virtual_time)
        return msg_id

    def collect(self, busy: frozenset[int]) -> list[Pending]:
        """Take the evaluate replies that are in; the evaluations now complete, in order.
        A client waited for while training whose task ended with no reply taken (rejected,
        timed out, withdrawn) is asked by an evaluate message instead."""
        replies = self.transport.receive(list(self.asked)) if self.asked else []
        for reply in replies:
            asked = self.asked.pop(reply.msg_id, None)
            if asked is not None:
                self.deliver(reply.msg_id, asked, self.check(asked, reply))
        for pending in self.pending:
            for client in [c for c in pending.training if c not in busy]:
                self.wait_for(pending, client, pending.training.pop(client))
        self.expire(time.monotonic())
        complete = []
        while self.pending and self.pending[0].complete:
            complete.append(self.pending.pop(0))
        return complete

    def deliver(self, msg_id: str, asked: Asked, score: Score | None) -> None:
        for pending in self.pending:
            if pending.waiting.pop(msg_id, None) is not None and score is not None:
                pending.scores[asked.client] = score

    def expire(self, now: float) -> None:
        """Evaluations past their deadline go on without the clients that did not answer."""
        for pending in self.pending:
            if now <= pending.deadline:
                continue
            for msg_id, client in pending.waiting.items():
                node = self.asked[msg_id].node if msg_id in self.asked else -1
                self.failures.warning(
                    (node, "no answer"),
                    "evaluation of client %d (node %d): did not answer in time; scored without it",
                    client,
                    node,
                )
            pending.waiting.clear()
            for client in pending.training:
                self.failures.warning(
                    (client, "no train reply"),
                    "evaluation: client %d's train reply (with its score) did not come in time; "
                    "scored without it",
                    client,
                )
            pending.training.clear()
        waited = {m for p in self.pending for m in p.waiting}
        self.asked = {m: a for m, a in self.asked.items() if m in waited}

    def check(self, asked: Asked, reply: Reply) -> Score | None:
        """The score an evaluate reply carries, or None (logged once per node and cause)."""
        reason = reply.invalid or (
            f"error reply (code {reply.error_code}): {reply.error}"
            if reply.error_code is not None
            else ""
        )
        if not reason:
            try:
                metrics = parse_eval_metrics(reply.metrics, self.bounded)
                if metrics[ReplyKeys.PARTITION_ID] != asked.client:
                    raise InvalidReply(f"reply claims client {metrics[ReplyKeys.PARTITION_ID]}")
                accuracy, loss = metrics[ReplyKeys.ACCURACY], metrics[ReplyKeys.LOSS]
                return Score(accuracy, loss, asked.version, asked.sent_at, from_training=False)
            except InvalidReply as err:
                reason = str(err)
        self.failures.warning(
            (asked.node, reason),
            "evaluation of client %d (node %d) rejected: %s",
            asked.client,
            asked.node,
            reason,
        )
        return None
