"""A reply checked against its task, the model's layout and the rule's signals, turned
into the `Update` a strategy consumes; anything that does not hold up is an InvalidReply."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedstale.common.models import ParamLayout
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
    sets = {name: layout.flatten(a) for name, a in reply.sets.items()}
    return update_of(
        arrival,
        strategy,
        Update(task.client, task.task_id, task.version, 0, metrics.num_examples,
               layout.flatten(reply.arrays), metrics.signals, metrics.compute_seconds, sets),
    )  # fmt: skip


def update_of(arrival: Arrival, strategy: Strategy, received: Update) -> Update:
    """The update the strategy consumes: what a contract read from the reply, with its
    staleness in versions and in arrivals; the rule's own checks (`validate`) passed."""
    task = arrival.task
    staleness, arrivals = arrival.version - task.version, arrival.accepted - task.accepted_before
    update = replace(received, staleness=staleness, arrivals=arrivals)
    strategy.validate(update)
    return update
