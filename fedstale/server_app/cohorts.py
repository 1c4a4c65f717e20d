"""`trainer=cohort` in Flower simulation: the train tasks waiting to be trained travel to one
node as one message, and its ClientApp trains them together (fedstale/common/cohort.py).

A train task is not pushed when the engine sends it but when the engine next waits for a
reply it lacks; then every task sent and not yet pushed (each client's first, in the order
sent) goes as one `train.cohort` message to the first one's node, each task under its own
partition (node-partitions=assign names it, and in simulation every node can load every
partition). The reply's parts answer the tasks one by one. A task's inputs are fixed when
it is sent, so its result does not depend on which cohort trains it: the engine's events
are those of per-task training. Tasks that must train alone (a client rule, optimiser or
loss that cohorts do not batch; no partition named) are sent as they are, said once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from fedstale.common.cohort import first_of_each, said_alone, said_together, solo_reason
from fedstale.common.config import RunConfig
from fedstale.common.records import ArraySets, cohort_content, frozen_copy, message_content
from fedstale.common.schema import ASSIGNED_PARTITION, MSG_COHORT, MSG_TRAIN, TaskSpec
from fedstale.server_app.transport import (
    NODE_UNAVAILABLE,
    UNCLAIMED_SECONDS,
    GridTransport,
    Reply,
    SendRefused,
    Transport,
)
from fedstale.strategies.registry import cohort_rules

log = logging.getLogger("fedstale")
TASK_PREFIX = "cohort-task-"
ELSEWHERE = (
    "trainer=cohort: a deployment's node holds only its own client's data, so each task "
    "trains alone on its node; cohorts form in Flower simulation and `fedstale run --local`"
)
NO_PARTITION = (
    "the tasks name no partition (node-partitions=ask), so only their own node can train "
    "them; set node-partitions=assign"
)


def grid_transport(grid: Grid, run: RunConfig) -> Transport:
    """The ServerApp's transport: cohorts in simulation under trainer=cohort."""
    transport = GridTransport(grid, run.task_ttl)
    if run.trainer != "cohort":
        return transport
    if not transport.simulated:
        log.info(ELSEWHERE)
        return transport
    return CohortGridTransport(transport, run.loss)


@dataclass(frozen=True)
class Waiting:
    """A train task sent by the engine and not yet pushed."""

    task_id: str
    node_id: int
    partition: int
    config: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray] | None
    sets: ArraySets | None


class CohortGridTransport:
    """A GridTransport whose train tasks travel in cohorts (see the module's doc)."""

    def __init__(self, inner: GridTransport, loss: str) -> None:
        self.inner = inner
        self.simulated = inner.simulated
        self.loss = loss
        self.waiting: list[Waiting] = []
        self.count = 0
        self.members: dict[str, list[str]] = {}  # cohort message id -> its tasks' ids
        self.cohort_of: dict[str, str] = {}  # task id -> its cohort message's id
        self.answered: dict[str, tuple[float, Reply]] = {}  # task id -> (when, its reply)
        self.cohort_sizes: list[int] = []  # tasks per cohort pushed
        self.said: set[str] = set()  # reasons for training alone, said once a run

    def node_ids(self) -> list[int]:
        return self.inner.node_ids()

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
        sets: ArraySets | None = None,
    ) -> str:
        if message_type != MSG_TRAIN or self.alone_because(config):
            return self.inner.send(node_id, message_type, config, arrays, sets)
        self.count += 1
        task_id = f"{TASK_PREFIX}{self.count}"
        partition = int(config[ASSIGNED_PARTITION])
        kept, kept_sets = frozen_copy(arrays, sets)  # pushed later: as they are now
        self.waiting.append(Waiting(task_id, node_id, partition, config, kept, kept_sets))
        return task_id

    def alone_because(self, config: Mapping[str, Any]) -> str:
        """Why a train task goes alone ("" when it joins a cohort); each reason said once."""
        why = solo_reason(TaskSpec.from_config(config), self.loss, cohort_rules())
        if not why and ASSIGNED_PARTITION not in config:
            why = NO_PARTITION
        if why:
            said_alone(why, self.said)
        return why

    def wait(self, seconds: float) -> None:
        if self.waiting:
            self.push_waiting()
        else:
            self.inner.wait(seconds)

    def push_waiting(self) -> None:
        cohort, self.waiting = first_of_each(self.waiting, lambda task: task.partition)
        parts = [message_content(t.config, t.arrays, t.sets) for t in cohort]
        try:
            msg_id = self.inner.push(cohort[0].node_id, MSG_COHORT, cohort_content(parts))
        except SendRefused as err:
            now = time.monotonic()
            for task in cohort:
                refused = Reply(task.task_id, error_code=NODE_UNAVAILABLE, error=str(err))
                self.answered[task.task_id] = (now, refused)
            return
        self.members[msg_id] = [task.task_id for task in cohort]
        self.cohort_of.update((task.task_id, msg_id) for task in cohort)
        self.cohort_sizes.append(len(cohort))
        said_together(len(cohort), f"in one message to node {cohort[0].node_id}")

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        wanted = list(msg_ids)
        plain = [m for m in wanted if not m.startswith(TASK_PREFIX)]
        cohorts = sorted({self.cohort_of[m] for m in wanted if m in self.cohort_of})
        replies = []
        for reply in self.inner.receive(plain + cohorts):
            if reply.msg_id in self.members:
                self.split(reply)
            else:
                replies.append(reply)
        replies += [self.answered.pop(m)[1] for m in wanted if m in self.answered]
        self.forget_unclaimed()
        return replies

    def split(self, reply: Reply) -> None:
        """A cohort's reply, answering each of its tasks."""
        task_ids = self.members.pop(reply.msg_id)
        for task_id in task_ids:
            del self.cohort_of[task_id]
        now = time.monotonic()
        for index, task_id in enumerate(task_ids):
            self.answered[task_id] = (now, part_of(reply, index, len(task_ids), task_id))

    def forget_unclaimed(self) -> None:
        """Replies nobody asked for within UNCLAIMED_SECONDS (their tasks were superseded)."""
        now = time.monotonic()
        for task_id in [t for t, (at, _) in self.answered.items() if now - at > UNCLAIMED_SECONDS]:
            del self.answered[task_id]


def part_of(reply: Reply, index: int, size: int, task_id: str) -> Reply:
    """Task `index`'s reply in a cohort's `reply` of `size` tasks."""
    if reply.error_code is not None:
        return replace(reply, msg_id=task_id)
    if reply.invalid:
        return Reply(task_id, invalid=f"its cohort's reply: {reply.invalid}")
    if len(reply.parts) != size:
        return Reply(task_id, invalid=f"a cohort of {size} tasks answered {len(reply.parts)}")
    return replace(reply.parts[index], msg_id=task_id)
