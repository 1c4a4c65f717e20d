"""Taking replies in: pulled from the transport and sorted to their tasks, checked through
the stages and the contract into an Update (or rejected, logged and counted), late
replies offered to the rule, and tasks retired that time out, lose their node or are
superseded. What the rule then does with an update is the engine's (`Sink`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from fedstale.common.schema import InvalidReply
from fedstale.server_app.clock import Task
from fedstale.server_app.contract import MissingSignal
from fedstale.server_app.replies import Arrival
from fedstale.server_app.tasks import EngineError, EnginePart
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Update

log = logging.getLogger("fedstale")


class Sink(Protocol):
    """Where the intake hands what it took in: the engine."""

    def accept(self, task: Task, reply: Reply, update: Update) -> None: ...

    def task_lost(self, client: int) -> None: ...


@dataclass
class Intake(EnginePart):
    sink: Sink
    missing_signals: int = 0  # replies without the rule's client signal

    def collect(self) -> None:
        """Pull whatever replies are ready; error replies retire their task at once, replies
        to superseded tasks are discarded, and those to written-off tasks are offered late."""
        book = self.standing.book
        for reply in self.federation.transport.receive(book.watched()):
            late = book.late(reply.msg_id)
            if late is not None:
                self.late(late, reply)
                continue
            task = book.sort(reply)
            if task is None:
                continue
            if reply.error_code is not None:
                reason = f"error reply (code {reply.error_code}): {reply.error}"
                self.retire(task, reason, may_answer=False)
            else:
                book.arrived[task.task_id] = reply

    def retire(self, task: Task, reason: str, may_answer: bool = True) -> None:
        """End a task without an update; its client becomes idle if its node is online. A
        task whose reply `may_answer` yet (timed out, node gone) stays watched until the
        SuperLink's TTL: a reply that comes is offered late (`late`)."""
        self.standing.book.drop(task)
        if may_answer:
            self.standing.book.write_off(task, time.monotonic() + self.run.task_ttl)
        else:
            self.forget(task.task_id)
        self.standing.counters.failed += 1
        log.warning(
            "task %d lost: node %d (client %d): %s", task.task_id, task.node, task.client, reason
        )
        self.sink.task_lost(task.client)

    def late(self, task: Task, reply: Reply) -> None:
        """A reply to a written-off task: taken by the rule unless it refuses (counted with
        the reason), never dropped silently. It counts once: the watch ended with it."""
        counters = self.standing.counters
        if reply.error_code is not None:
            self.forget(task.task_id)
            log.info("task %d (client %d) ended with an error reply too", task.task_id, task.client)
            return
        reason = self.strategy.refuses_late(self.standing.in_flight(task))
        if reason:
            self.forget(task.task_id)
            counters.late_refused[reason] = counters.late_refused.get(reason, 0) + 1
            log.warning(
                "late reply to task %d (client %d) refused: %s", task.task_id, task.client, reason
            )
            return
        self.standing.book.answered.add(task.task_id)  # as `TaskBook.take` does for a live task
        update = self.checked(task, reply, on_reject=lambda: None)
        if update is None:
            return
        log.info(
            "late reply to task %d (client %d) taken, staleness %d",
            task.task_id,
            task.client,
            update.staleness,
        )
        counters.failed -= 1
        counters.late += 1
        self.sink.accept(task, reply, replace(update, late=True))

    def supersede(self, task_ids: list[int]) -> None:
        """Withdraw tasks in flight: a reply that is in is dropped now, one still to come is
        dropped when it arrives; each counts as superseded, never as lost or accepted."""
        for task_id in task_ids:
            task = self.standing.book.withdraw(task_id)
            if task is None:
                raise RuntimeError(
                    f"strategy {self.strategy.name} superseded task {task_id}, not in flight"
                )
            self.forget(task_id)
            self.standing.counters.superseded += 1
            log.debug("task %d (client %d) superseded", task_id, task.client)

    def expire_overdue(self) -> None:
        """Retire tasks that have gone unanswered past `task-timeout` (a node that is alive
        but never answers would otherwise hold the virtual clock until Flower's TTL)."""
        now = time.monotonic()
        for task in self.standing.book.overdue(now):
            self.retire(task, f"no reply within task-timeout {self.run.task_timeout:g} s")
        for task in self.standing.book.unwatched(now):
            self.forget(task.task_id)

    def checked(self, task: Task, reply: Reply, on_reject: Callable[[], None]) -> Update | None:
        """The reply as an Update, or None when it is rejected (logged, counted, then
        `on_reject`)."""
        standing = self.standing
        try:
            accepted, answered = standing.counters.accepted, standing.book.answered
            arrival = Arrival(task, standing.version, accepted, answered)
            seen = self.stages.reply(task.task_id, task.client, reply)
            update = self.federation.contract.update(
                arrival, seen, self.strategy, self.federation.layout
            )
            return self.stages.update(task.task_id, update)
        except InvalidReply as err:
            self.reject(task, err)
            on_reject()
            return None
        finally:
            self.forget(task.task_id)

    def reject(self, task: Task, err: InvalidReply) -> None:
        """Log and count a reply that cannot be used. Replies that all lack the rule's
        client signal before any update was accepted mean the ClientApp lacks the rule's
        client half: the run stops with that one line."""
        self.standing.counters.rejected += 1
        log.warning(
            "rejected update: node %d, task %d (client %d): %s",
            task.node,
            task.task_id,
            task.client,
            err,
        )
        excluded_for = self.stages.excludes(task.node, task.client, err)
        if excluded_for:
            self.exclude(task.node, excluded_for)
        if isinstance(err, MissingSignal):
            self.missing_signals += 1
            accepted = self.standing.counters.accepted
            if not accepted and self.missing_signals >= self.run.concurrency:
                raise EngineError(str(err))

    def exclude(self, node: int, excluded_for: str) -> None:
        """Exclude a node a stage refuses (central DP: its updates exceed the clipping norm)
        and retire its tasks; with no node left, the run ends (its results kept)."""
        self.federation.nodes.exclude(node)
        for other in self.standing.book.on_nodes({node}):
            self.retire(other, "its node was excluded", may_answer=False)
        if not self.federation.nodes.clients:
            self.standing.stop_reason = f"every node was excluded for {excluded_for}"

    def forget(self, task_id: int) -> None:
        """Task `task_id` ended (answered, lost or superseded): what was kept for it goes."""
        self.federation.contract.forget(task_id)
        self.stages.forget(task_id)
