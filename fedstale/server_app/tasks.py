"""The engine's book of tasks: those in flight (by task id and by message id), the replies
that are in but not yet handled (the clock decides when), the ids already answered,
superseded messages whose late replies are still to be dropped, and written-off tasks
(timed out, node gone) whose replies may still come and are then offered late. And where
the run stands (`Standing`), which the engine shares with its dispatcher and intake."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from fedstale.common.config import RunConfig
from fedstale.server_app.budgets import Counters, Stopwatch
from fedstale.server_app.clock import Clock, Task
from fedstale.server_app.federation import Federation
from fedstale.server_app.stages.pipeline import Pipeline
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import InFlight, Strategy, View

log = logging.getLogger("fedstale")


class EngineError(RuntimeError):
    """The run cannot go on (no nodes, a federation that does not match the config)."""


class TaskBook:
    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}
        self.by_msg: dict[str, int] = {}
        self.arrived: dict[int, Reply] = {}
        self.answered: set[int] = set()
        self.superseded: dict[str, int] = {}  # message id of a superseded task -> its node
        self.written_off: dict[str, tuple[Task, float]] = {}  # msg id -> (task, watch until)

    def __len__(self) -> int:
        return len(self.tasks)

    @property
    def busy(self) -> set[int]:
        return {t.client for t in self.tasks.values()}

    def per_client(self) -> Counter[int]:
        return Counter(t.client for t in self.tasks.values())

    def add(self, task: Task) -> None:
        self.tasks[task.task_id] = task
        self.by_msg[task.msg_id] = task.task_id

    def watched(self) -> list[str]:
        """The message ids whose replies the engine still wants to see."""
        return [*self.by_msg, *self.superseded, *self.written_off]

    def sort(self, reply: Reply) -> Task | None:
        """The task a fresh reply answers; None for a reply to drop (superseded, unknown)."""
        if self.superseded.pop(reply.msg_id, None) is not None:
            log.debug("discarded the reply to superseded message %s", reply.msg_id)
            return None
        task_id = self.by_msg.pop(reply.msg_id, None)
        if task_id is None:
            log.warning("ignored a reply to unknown message %s", reply.msg_id)
            return None
        return self.tasks[task_id]

    def drop(self, task: Task) -> None:
        """Forget a task that ended without an update."""
        self.tasks.pop(task.task_id, None)
        self.by_msg.pop(task.msg_id, None)
        self.arrived.pop(task.task_id, None)

    def write_off(self, task: Task, watch_until: float) -> None:
        """A task given up on whose reply may still come until `watch_until` (monotonic)."""
        self.written_off[task.msg_id] = (task, watch_until)

    def late(self, msg_id: str) -> Task | None:
        """The written-off task a reply answers, if any (its watch ends)."""
        entry = self.written_off.pop(msg_id, None)
        return None if entry is None else entry[0]

    def unwatched(self, now: float) -> list[Task]:
        """Written-off tasks whose watch has run out; no longer watched."""
        over = [m for m, (_, until) in self.written_off.items() if until < now]
        return [self.written_off.pop(m)[0] for m in over]

    def withdraw(self, task_id: int) -> Task | None:
        """Take a task out of flight; a reply still to come is dropped when it arrives."""
        task = self.tasks.pop(task_id, None)
        if task is None:
            return None
        self.by_msg.pop(task.msg_id, None)
        if self.arrived.pop(task_id, None) is None:
            self.superseded[task.msg_id] = task.node
        return task

    def take(self, task: Task) -> Reply:
        """The reply of a task the clock lets the engine handle now; the task is answered."""
        self.tasks.pop(task.task_id)
        self.answered.add(task.task_id)
        return self.arrived.pop(task.task_id)

    def overdue(self, now: float) -> list[Task]:
        """Tasks past their deadline with no reply in."""
        return [
            t for t in self.tasks.values() if t.deadline < now and t.task_id not in self.arrived
        ]

    def moved(self, node_of: Mapping[int, int]) -> list[Task]:
        """Tasks with no reply in whose client another node now serves: a SuperNode started
        again after a crash claims its partition long before the SuperLink misses the old
        node's heartbeats (about a minute), and until then the task held the client."""
        return [
            t
            for t in self.tasks.values()
            if t.task_id not in self.arrived and node_of.get(t.client, t.node) != t.node
        ]

    def on_nodes(self, gone: set[int]) -> list[Task]:
        """Tasks of nodes that went offline; their superseded messages are forgotten."""
        for msg_id in [m for m, node in self.superseded.items() if node in gone]:
            del self.superseded[msg_id]
        return [t for t in self.tasks.values() if t.node in gone]


@dataclass
class Standing:
    """Where the run stands: its clock, its tasks, its counters, the global version, the
    next task's id, why it stops ("" while it goes on) and the seconds of each phase."""

    clock: Clock
    book: TaskBook = field(default_factory=TaskBook)
    counters: Counters = field(default_factory=Counters)
    version: int = 0
    next_task_id: int = 0
    stop_reason: str = ""
    watch: Stopwatch = field(default_factory=Stopwatch)

    def in_flight(self, task: Task) -> InFlight:
        """A task as a strategy sees it: staleness in versions and in arrivals."""
        arrivals = self.counters.accepted - task.accepted_before
        return InFlight(
            task.task_id, task.client, task.version, self.version - task.version, arrivals
        )

    def view(self, candidates: list[int], capacity: int) -> View:
        in_flight = tuple(self.in_flight(t) for t in self.book.tasks.values())
        return View(self.version, tuple(candidates), in_flight, capacity)


@dataclass
class EnginePart:
    """What the engine hands each of its parts (the dispatcher, the intake): the run, the
    rule, the federation, the stages, and where the run stands (shared, not copied)."""

    run: RunConfig
    strategy: Strategy
    federation: Federation
    stages: Pipeline
    standing: Standing
