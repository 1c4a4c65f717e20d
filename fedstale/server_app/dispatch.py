"""Sending work: which clients may take a task now, what a task carries (its settings, the
rule's entries, the stages' parts), and the message that starts it. The stages send their
own messages the same way (`StageMessages`)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedstale.common.schema import ARRAYS, MSG_TRAIN, TaskSpec
from fedstale.common.seeding import task_seed
from fedstale.server_app.clock import Task
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.stages.pipeline import Sets
from fedstale.server_app.tasks import EnginePart
from fedstale.server_app.transport import Reply, SendRefused
from fedstale.strategies.base import Assignment

log = logging.getLogger("fedstale")


@dataclass
class Dispatcher(EnginePart):
    scores: Scoreboard

    def idle_clients(self) -> list[int]:
        busy = self.standing.book.busy
        return [c for c in self.federation.nodes.clients if c not in busy]

    def candidates(self) -> tuple[list[int], int]:
        """Idle clients while fewer than `concurrency` tasks run; then, with `prefetch`,
        clients that may queue a second task (those with exactly one), up to twice
        `concurrency`. With how many tasks may start."""
        concurrency, book = self.run.concurrency, self.standing.book
        if len(book) < concurrency:
            idle = self.idle_clients()
            if idle:
                return idle, concurrency - len(book)
        if self.run.prefetch and len(book) < 2 * concurrency:
            counts = book.per_client()
            queuing = [c for c in self.federation.nodes.clients if counts.get(c) == 1]
            return queuing, 2 * concurrency - len(book)
        return [], 0

    def check_plan(self, plan: list[Assignment], candidates: list[int], capacity: int) -> None:
        clients = [a.client for a in plan]
        if len(plan) > capacity or len(set(clients)) < len(clients):
            raise RuntimeError(
                f"strategy {self.strategy.name} planned {clients} with room for {capacity} "
                "distinct clients"
            )
        unavailable = sorted(set(clients) - set(candidates))
        if unavailable:
            raise RuntimeError(
                f"strategy {self.strategy.name} planned clients {unavailable} "
                "that cannot take a task now"
            )

    def dispatch_now(self, assignments: list[Assignment]) -> None:
        """The replacements an outcome names, sent at once to clients that are idle now."""
        if assignments:
            self.check_plan(assignments, self.idle_clients(), len(assignments))
        for assignment in assignments:
            self.dispatch(assignment)

    def task_spec(self, task_id: int, assignment: Assignment) -> TaskSpec:
        run, version = self.run, self.standing.version
        training = {**run.client_training(), "lr": run.lr * run.lr_decay**version}
        spec = TaskSpec(
            task_id=task_id,
            version=version,
            seed=task_seed(run.seed, assignment.client, task_id),
            returns=self.strategy.returns,
            **training,
            rules=tuple(rule.name for rule in self.strategy.client_rules),
            extra={
                **assignment.entries,
                **self.scores.task_entries(),
                **self.stages.task_entries(),
                **self.federation.nodes.entries(assignment.client),
            },
        )
        return replace(spec, **assignment.settings)

    def dispatch(self, assignment: Assignment) -> None:
        with self.standing.watch("dispatch"):
            self.start(assignment)

    def start(self, assignment: Assignment) -> None:
        """Send the task's message and put the task in the book (a node that refused the
        message is forgotten until it comes back)."""
        federation, standing = self.federation, self.standing
        client, task_id = assignment.client, standing.next_task_id
        node = federation.nodes.node_of[client]
        spec = self.task_spec(task_id, assignment)
        models = {name: federation.layout.unflatten(v) for name, v in assignment.models.items()}
        main = federation.contract.outgoing(models.pop(ARRAYS))
        carries = federation.contract.replies_carry(self.strategy.returns)
        stage_config, stage_sets = self.stages.task_parts(task_id, client, carries)
        config = {**federation.contract.task_config(spec, assignment), **stage_config}
        try:
            msg_id = self.send(node, config, main, {**models, **stage_sets})
        except SendRefused as err:
            log.warning(
                "node %d (client %d) left: %s; it gets no work until it returns", node, client, err
            )
            federation.nodes.forget(node)
            return
        standing.next_task_id += 1
        federation.contract.sent(task_id, assignment.models[ARRAYS])
        self.stages.sent(task_id, assignment.models[ARRAYS], self.strategy.returns, carries)
        latency = federation.latency.task_latency(client, task_id, spec)
        timeout = self.run.task_timeout
        standing.book.add(
            Task(
                task_id=task_id,
                client=client,
                node=node,
                msg_id=msg_id,
                version=standing.version,
                accepted_before=standing.counters.accepted,
                dispatched_at=standing.clock.now(),
                finishes_at=standing.clock.finish_time(latency),
                deadline=time.monotonic() + timeout if timeout else math.inf,
                sets=tuple(sorted(assignment.reply_sets)),
            )
        )
        self.strategy.on_dispatch(client)
        standing.counters.dispatched += 1

    def send(
        self, node: int, config: dict[str, Any], arrays: dict[str, np.ndarray], sets: Sets
    ) -> str:
        """Every train message the run sends, a task's or a stage's (SendRefused: the node
        left)."""
        return self.federation.transport.send(node, MSG_TRAIN, config, arrays, sets or None)


class StageMessages:
    """The stages' way to the clients: a client's node looked up, the message sent as every
    task is (`Dispatcher.send`); a client without a node, or a node that refused, gets
    none."""

    def __init__(self, dispatcher: Dispatcher, poll_interval: float) -> None:
        self.dispatcher = dispatcher
        self.poll_interval = poll_interval

    def send(self, client: int, config: dict[str, Any], sets: Sets) -> str | None:
        node = self.dispatcher.federation.nodes.node_of.get(client)
        if node is None:
            return None
        try:
            return self.dispatcher.send(node, config, {}, sets)
        except SendRefused:
            return None

    def receive(self, msg_ids: list[str]) -> list[Reply]:
        return self.dispatcher.federation.transport.receive(msg_ids)

    def pause(self) -> None:
        self.dispatcher.federation.transport.wait(self.poll_interval)
