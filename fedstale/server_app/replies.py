"""A reply checked against its task, the model's layout and the rule's signals, turned
into the `Update` a strategy consumes; anything that does not hold up is an InvalidReply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedstale.common.layout import ParamLayout
from fedstale.common.schema import InvalidReply, check_arrays, parse_train_metrics
from fedstale.server_app.clock import Task
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Strategy, Update


@dataclass(frozen=True)
class Arrival:
    """A reply's task and the moment it arrives: the global version now, the updates
    accepted so far, and the task ids already answered (a reply naming one is a replay)."""

    task: Task
    version: int = 0
    accepted: int = 0
    answered: frozenset[int] | set[int] = frozenset()


def validated(arrival: Arrival, reply: Reply, strategy: Strategy, layout: ParamLayout) -> Update:
    """fedstale's own ClientApp's reply, checked in full."""
    task, answered = arrival.task, arrival.answered
    if reply.invalid:
        raise InvalidReply(reply.invalid)
    metrics = parse_train_metrics(reply.metrics, strategy.signals())
    if metrics.task_id != task.task_id:
        seen = "an answered" if metrics.task_id in answered else "an unknown"
        raise InvalidReply(f"reply names {seen} task {metrics.task_id}")
    if metrics.partition_id != task.client:
        raise InvalidReply(f"reply claims client {metrics.partition_id}")
    if reply.arrays is None:
        raise InvalidReply("reply carries no arrays")
    expected = sorted(task.sets)
    if sorted(reply.sets) != expected:
        raise InvalidReply(f"reply carries array sets {sorted(reply.sets)}, expected {expected}")
    for arrays in (reply.arrays, *reply.sets.values()):
        check_arrays(arrays, layout.names, layout.shapes)
    return update_of(
        arrival,
        strategy,
        num_examples=metrics.num_examples,
        vector=layout.flatten(reply.arrays),
        signals=metrics.signals,
        compute_seconds=metrics.compute_seconds,
        sets={name: layout.flatten(a) for name, a in reply.sets.items()},
    )


def update_of(
    arrival: Arrival,
    strategy: Strategy,
    *,
    num_examples: int,
    vector: np.ndarray,
    signals: dict[str, Any],
    compute_seconds: float,
    sets: dict[str, np.ndarray],
) -> Update:
    """The update the strategy consumes, from what a contract read of the reply: its
    staleness in versions and in arrivals; the rule's own checks (`validate`) passed."""
    task = arrival.task
    update = Update(
        client=task.client,
        task_id=task.task_id,
        base_version=task.version,
        staleness=arrival.version - task.version,
        num_examples=num_examples,
        vector=vector,
        signals=signals,
        compute_seconds=compute_seconds,
        sets=sets,
        arrivals=arrival.accepted - task.accepted_before,
    )
    strategy.validate(update)
    return update
