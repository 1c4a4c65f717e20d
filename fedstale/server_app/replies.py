"""A reply checked against its task, the model's layout and the rule's signals, turned
into the `Update` a strategy consumes; anything that does not hold up is an InvalidReply."""

from __future__ import annotations

from fedstale.common.models import ParamLayout
from fedstale.common.schema import InvalidReply, check_arrays, parse_train_metrics
from fedstale.server_app.clock import Task
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Strategy, Update


def validated(
    task: Task,
    reply: Reply,
    strategy: Strategy,
    layout: ParamLayout,
    version: int,
    accepted: int,
    answered: set[int],
) -> Update:
    """`version`: the global version now; `accepted`: updates accepted so far;
    `answered`: task ids already answered (a reply naming one is a replay)."""
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
    update = Update(
        client=task.client,
        task_id=task.task_id,
        base_version=task.version,
        staleness=version - task.version,
        num_examples=metrics.num_examples,
        vector=layout.flatten(reply.arrays),
        signals=metrics.signals,
        compute_seconds=metrics.compute_seconds,
        sets={name: layout.flatten(a) for name, a in reply.sets.items()},
        arrivals=accepted - task.accepted_before,
    )
    strategy.validate(update)
    return update
