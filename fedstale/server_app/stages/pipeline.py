"""The stages around the rule, in the order an update meets them: a reply first (secure
aggregation unmasks it), then its update (central DP clips it), the rule, then the rule's
release (secure aggregation adds the buffer's sum, central DP noises it and writes its
ledger), then the rows recorded. The engine calls one `Pipeline` of the stages that are on;
a stage that is off is not in it.

A stage overrides the hooks it needs; every other hook leaves what it is handed as it was.
A stage that logs each update's norm:

    class NormLog(Stage):
        def update(self, task_id: int, update: Update) -> Update:
            log.info("task %d: norm %.3g", task_id, float(np.linalg.norm(update.vector)))
            return update

A stage's own messages to clients (secure aggregation's key round and shares) go through
the engine's `Messages`, the way every task goes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from fedstale.common.schema import InvalidReply
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Outcome, Strategy, Update

Sets = dict[str, dict[str, np.ndarray]]
Request = tuple[int, dict[str, Any], Sets]  # client, config, array sets


class StageError(RuntimeError):
    """The run cannot start or go on (a stage's one line: what was wrong, what to do)."""


@dataclass(frozen=True)
class Verdict:
    """What became of a new global model: released, or not (withheld under a privacy
    budget, a buffer dropped); `stop`: why the run must stop now ("" goes on)."""

    released: bool = True
    stop: str = ""


class Messages(Protocol):
    """The engine's way to the clients, for a stage's own protocol."""

    def send(self, client: int, config: dict[str, Any], sets: Sets) -> str | None:
        """The message's id; None where the client has no node or its node refused it."""

    def receive(self, msg_ids: list[str]) -> list[Reply]:
        """The replies to those messages that are in."""

    def pause(self) -> None:
        """Wait one poll interval (less where the transport can tell a reply came)."""


class Stage:
    """One stage of the update path. `key`: its part of a checkpoint ("": none)."""

    key: ClassVar[str] = ""

    @property
    def keeps_client_values(self) -> bool:
        """Whether checkpoints and outputs may hold per-client, data-dependent values."""
        return True

    def opening(self, strategy: Strategy[Any]) -> str:
        """Before the loop, from the strategy's model: why no model can be released ("")."""
        return ""

    def joined(self, clients: list[int], messages: Messages) -> list[int]:
        """The clients are online, before the first task: those that cannot take part."""
        return []

    def task_entries(self) -> dict[str, Any]:
        """Entries of every task's settings (the client reads them as its own)."""
        return {}

    def task_parts(self, task_id: int, client: int, carries: str) -> tuple[dict[str, Any], Sets]:
        """A train message's config entries and array sets (its reply carries `carries`)."""
        return {}, {}

    def sent(self, task_id: int, start: np.ndarray, returns: str, carries: str) -> None:
        """Task `task_id` starts from the flat model `start`; the rule takes `returns` back,
        the wire carries `carries`."""

    def reply(self, task_id: int, client: int, reply: Reply) -> Reply:
        """The reply as the next stage may see it (InvalidReply: rejected)."""
        return reply

    def update(self, task_id: int, update: Update) -> Update:
        """The update as the rule may see it (InvalidReply: rejected)."""
        return update

    def excludes(self, node: int, client: int, err: InvalidReply) -> str:
        """Whether this rejection excludes the node from the run: "" keeps it; else what
        excluded it, in the line that ends a run once no node is left ("every node was
        excluded for ...")."""
        return ""

    def release(
        self, strategy: Strategy[Any], outcome: Outcome, version: int, messages: Messages
    ) -> Verdict:
        """The rule changed its model into `version`: release it, or not."""
        return Verdict()

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        """An updates.jsonl row as this stage lets it be written."""
        return row

    def forget(self, task_id: int) -> None:
        """Task `task_id` ended: what was kept for it goes."""

    def summary(self) -> dict[str, Any]:
        return {}

    def figures(self) -> dict[str, float]:
        """Numbers a tracker charts per version (`<stage key>/<name>`), as the run goes."""
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""


S = TypeVar("S", bound=Stage)


class Pipeline:
    """The stages that are on, in order; each hook runs through all of them."""

    def __init__(self, stages: Sequence[Stage] = ()) -> None:
        self.stages = tuple(stages)

    def find(self, kind: type[S]) -> S | None:
        return next((stage for stage in self.stages if isinstance(stage, kind)), None)

    @property
    def keeps_client_values(self) -> bool:
        return all(stage.keeps_client_values for stage in self.stages)

    def opening(self, strategy: Strategy[Any]) -> str:
        return next((why for stage in self.stages if (why := stage.opening(strategy))), "")

    def joined(self, clients: list[int], messages: Messages) -> list[int]:
        left_out: list[int] = []
        for stage in self.stages:
            left_out += [c for c in stage.joined(clients, messages) if c not in left_out]
        return left_out

    def task_entries(self) -> dict[str, Any]:
        return {k: v for stage in self.stages for k, v in stage.task_entries().items()}

    def task_parts(self, task_id: int, client: int, carries: str) -> tuple[dict[str, Any], Sets]:
        config: dict[str, Any] = {}
        sets: Sets = {}
        for stage in self.stages:
            more_config, more_sets = stage.task_parts(task_id, client, carries)
            config |= more_config
            sets |= more_sets
        return config, sets

    def sent(self, task_id: int, start: np.ndarray, returns: str, carries: str) -> None:
        for stage in self.stages:
            stage.sent(task_id, start, returns, carries)

    def reply(self, task_id: int, client: int, reply: Reply) -> Reply:
        for stage in self.stages:
            reply = stage.reply(task_id, client, reply)
        return reply

    def update(self, task_id: int, update: Update) -> Update:
        for stage in self.stages:
            update = stage.update(task_id, update)
        return update

    def excludes(self, node: int, client: int, err: InvalidReply) -> str:
        # a list, not a generator: every stage counts the rejection, even after one excludes
        return next(iter(filter(None, [s.excludes(node, client, err) for s in self.stages])), "")

    def release(
        self, strategy: Strategy[Any], outcome: Outcome, version: int, messages: Messages
    ) -> Verdict:
        """Each stage in turn until one does not release; a later stage's stop wins."""
        released, stop = True, ""
        for stage in self.stages:
            verdict = stage.release(strategy, outcome, version, messages)
            released, stop = verdict.released, verdict.stop or stop
            if not released:
                break
        return Verdict(released, stop)

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        for stage in self.stages:
            row = stage.record(row)
        return row

    def forget(self, task_id: int) -> None:
        for stage in self.stages:
            stage.forget(task_id)

    def summary(self) -> dict[str, Any]:
        return {k: v for stage in self.stages for k, v in stage.summary().items()}

    def figures(self) -> dict[str, float]:
        return {k: v for stage in self.stages for k, v in stage.figures().items()}

    def state(self) -> dict[str, Any]:
        return {stage.key: stage.state() for stage in self.stages if stage.key}

    def load_state(self, state: dict[str, Any]) -> None:
        for stage in self.stages:
            stage.load_state(state.get(stage.key, {}))


def gather(
    messages: Messages, requests: list[Request], needed: int, seconds: float
) -> list[tuple[int, Reply]]:
    """Send every request at once; gather the replies until `needed` came without an error,
    every one came, or `seconds` passed. Each reply with the client it came from."""
    sent: dict[str, int] = {}
    for client, config, sets in requests:
        msg_id = messages.send(client, config, sets)
        if msg_id is not None:
            sent[msg_id] = client
    replies: list[tuple[int, Reply]] = []
    deadline = time.monotonic() + seconds
    while sent and time.monotonic() < deadline:
        for reply in messages.receive(list(sent)):
            replies.append((sent.pop(reply.msg_id), reply))
        if sum(r.error_code is None for _, r in replies) >= needed:
            break
        if sent:
            messages.pause()
    return replies
