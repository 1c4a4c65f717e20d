"""The engine's only contact with Flower: push tasks, pull replies, list nodes.

`GridTransport` wraps Flower's Grid (push_messages / pull_messages / get_node_ids). Replies
come back as plain `Reply` records so that the engine's ordering logic can be driven by a
scripted transport in unit tests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from common.records import from_array_record, to_array_record
from common.schema import ARRAYS, CONFIG, METRICS

log = logging.getLogger("fedstale")


@dataclass
class Reply:
    """A reply to message `msg_id`: an error, or metrics with optional arrays.
    `invalid` is set when the content does not even have the expected record types."""

    msg_id: str
    error_code: int | None = None
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    invalid: str = ""


class SendRefused(RuntimeError):
    """The SuperLink did not accept a message (its node has just left)."""


class Transport(Protocol):
    def node_ids(self) -> list[int]: ...

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
    ) -> str: ...

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]: ...


def _content(config: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None) -> RecordDict:
    content = RecordDict({CONFIG: ConfigRecord(dict(config))})
    if arrays is not None:
        content[ARRAYS] = to_array_record(arrays)
    return content


def reply_from_message(msg: Message) -> Reply:
    msg_id = msg.metadata.reply_to_message_id
    if msg.has_error():
        return Reply(msg_id, error_code=int(msg.error.code), error=str(msg.error.reason))
    metrics = msg.content.get(METRICS)
    if not isinstance(metrics, MetricRecord):
        return Reply(msg_id, invalid="reply has no MetricRecord 'metrics'")
    arrays = msg.content.get(ARRAYS)
    if arrays is not None and not isinstance(arrays, ArrayRecord):
        return Reply(msg_id, invalid="reply's 'arrays' is not an ArrayRecord")
    try:
        decoded = None if arrays is None else from_array_record(arrays)
    except (ValueError, TypeError) as err:
        return Reply(msg_id, invalid=f"reply's arrays cannot be decoded: {err}")
    return Reply(msg_id, metrics=dict(metrics), arrays=decoded)


class GridTransport:
    """Transport over a Flower Grid (simulation or deployment alike)."""

    def __init__(self, grid: Grid, ttl: float) -> None:
        self.grid = grid
        self.ttl = ttl

    def node_ids(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
    ) -> str:
        message = Message(
            _content(config, arrays), dst_node_id=node_id, message_type=message_type, ttl=self.ttl
        )
        ids = list(self.grid.push_messages([message]))
        if not ids or not ids[0]:
            raise SendRefused(f"the SuperLink refused a {message_type} message to node {node_id}")
        return str(ids[0])

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        wanted = list(msg_ids)
        if not wanted:
            return []
        return [reply_from_message(m) for m in self.grid.pull_messages(wanted)]
