"""The engine's only contact with Flower: push tasks, pull replies, list nodes.

`GridTransport` wraps Flower's Grid (push_messages / pull_messages / get_node_ids). Replies
come back as plain `Reply` records so that the engine's ordering logic can be driven by a
scripted transport in unit tests.

Pulls run in a thread of their own. Flower's `pull_messages` blocks until every object of
every reply it took is downloaded; a node that dies mid-upload leaves a reply whose objects
never come, and the pull then waits out the SuperLink's object-push session (180 s in
Flower 1.41) before it answers with an error. A pull still running after `pull_wait` is left
to finish on its own (its replies are delivered when it does) and a later `receive` starts
a fresh one, so the other clients' replies, node refreshes and dispatch go on meanwhile;
how overlapping pulls of one id are kept from losing its reply: `GridTransport`.
A late pull may bring replies that a different caller waits for (task replies and node
queries share the transport), so replies wait in `ready` until someone asks for them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedstale.common.records import (
    ArraySets,
    cohort_parts,
    decode_sets,
    from_array_record,
    message_content,
)
from fedstale.common.schema import ARRAYS, CONFIG, METRICS, ReplyKeys

log = logging.getLogger("fedstale")

PULL_WAIT_SECONDS = 2.0
UNCLAIMED_SECONDS = 60.0
NODE_UNAVAILABLE = 5  # Flower's ErrorCode.NODE_UNAVAILABLE (flwr.common.constant)
IDLE_POLL_MAX_SECONDS = 0.25  # the longest idle wait between pulls of a real SuperLink


@dataclass
class Reply:
    """A reply to message `msg_id`: an error, or metrics with optional arrays (the main set)
    and other named array sets. `invalid` is set when the content does not even have the
    expected record types; `problem` is a node's own account of why it cannot serve."""

    msg_id: str
    error_code: int | None = None
    error: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] | None = None
    sets: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    invalid: str = ""
    problem: str = ""
    parts: list[Reply] = field(default_factory=list)  # a cohort's replies (cohorts.py)


class SendRefused(RuntimeError):
    """The SuperLink did not accept a message (its node has just left)."""


class Transport(Protocol):
    # True where the federation is simulated (Flower simulation, in-process): the server
    # can score per-client models itself instead of sending evaluate messages.
    simulated: bool

    def node_ids(self) -> list[int]: ...

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
        sets: ArraySets | None = None,
    ) -> str: ...

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]: ...

    def wait(self, seconds: float) -> None:
        """The engine's idle poll: sleep, or less when the transport knows work finished."""
        ...


def reply_from_message(msg: Message) -> Reply:
    msg_id = msg.metadata.reply_to_message_id
    if msg.has_error():
        return Reply(msg_id, error_code=int(msg.error.code), error=str(msg.error.reason))
    try:
        parts = cohort_parts(msg.content)
    except ValueError as err:
        return Reply(msg_id, invalid=str(err))
    if parts is not None:
        return Reply(msg_id, parts=[reply_from_content("", part) for part in parts])
    return reply_from_content(msg_id, msg.content)


def reply_from_content(msg_id: str, content: RecordDict) -> Reply:
    config = content.get(CONFIG)
    problem = str(config.get(ReplyKeys.PROBLEM, "")) if isinstance(config, ConfigRecord) else ""
    metrics = content.get(METRICS)
    if not isinstance(metrics, MetricRecord):
        return Reply(msg_id, invalid="reply has no MetricRecord 'metrics'", problem=problem)
    arrays = content.get(ARRAYS)
    if arrays is not None and not isinstance(arrays, ArrayRecord):
        return Reply(msg_id, invalid="reply's 'arrays' is not an ArrayRecord")
    try:
        decoded = None if arrays is None else from_array_record(arrays)
        sets = decode_sets(content)
    except (ValueError, TypeError) as err:
        return Reply(msg_id, invalid=f"reply's arrays cannot be decoded: {err}")
    return Reply(msg_id, metrics=dict(metrics), arrays=decoded, sets=sets, problem=problem)


class Pull:
    """One `grid.pull_messages` call on a daemon thread (a stuck one must not hold up exit)."""

    def __init__(self, grid: Grid, msg_ids: list[str]) -> None:
        self.started = time.monotonic()
        self.ids = frozenset(msg_ids)
        self.done = threading.Event()
        self.replies: list[Reply] = []
        self.failure: BaseException | None = None
        self.reported = False
        threading.Thread(target=self._run, args=(grid, msg_ids), daemon=True).start()

    def _run(self, grid: Grid, msg_ids: list[str]) -> None:
        try:
            self.replies = [reply_from_message(m) for m in grid.pull_messages(msg_ids)]
        except BaseException as err:  # handed to the engine's thread by `result`
            self.failure = err
        finally:
            self.done.set()

    def result(self) -> list[Reply]:
        if self.failure is not None:
            raise self.failure
        return self.replies


class GridTransport:
    """Transport over a Flower Grid (simulation or deployment alike).

    The SuperLink hands a reply to the first pull that asks for it and deletes it; a second
    pull of the same id that reaches the SuperLink meanwhile is answered with an error
    ("Message Unavailable"). So a reply is never lost to such an error:
    - an id is pulled again only once every pull asking for it has run `pull_wait` (a pull
      stuck on one node's upload must not hold up the others' replies);
    - a real reply always wins over an error reply to the same id, in whatever order their
      pulls finish;
    - an error reply to an id that another pull still running may bring is held until that
      pull ends, and dropped if it brought the reply (or the reply was already delivered).
    """

    def __init__(self, grid: Grid, ttl: float, pull_wait: float = PULL_WAIT_SECONDS) -> None:
        self.grid = grid
        self.simulated = type(grid).__name__ == "InMemoryGrid"  # Flower simulation's Grid
        self.ttl = ttl
        self.pull_wait = pull_wait
        self.overlaps_said: set[str] = set()
        self.pulls: list[Pull] = []
        self.ready: dict[str, tuple[float, Reply]] = {}  # msg_id -> (when pulled, reply)
        self.held: dict[str, Reply] = {}  # error replies another running pull may overrule
        self.delivered: dict[str, float] = {}  # msg_id -> when its real reply was handed out
        self.quiet_waits = 0  # idle waits since the last reply or send
        self.stalled_since: float | None = None  # a slow pull was said and still runs

    def node_ids(self) -> list[int]:
        return sorted(int(n) for n in self.grid.get_node_ids())

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
        sets: ArraySets | None = None,
    ) -> str:
        return self.push(node_id, message_type, message_content(config, arrays, sets))

    def push(self, node_id: int, message_type: str, content: RecordDict) -> str:
        message = Message(content, dst_node_id=node_id, message_type=message_type, ttl=self.ttl)
        self.quiet_waits = 0
        ids = list(self.grid.push_messages([message]))
        if not ids or not ids[0]:
            raise SendRefused(f"the SuperLink refused a {message_type} message to node {node_id}")
        return str(ids[0])

    def wait(self, seconds: float) -> None:
        """Sleep `seconds` between pulls of Flower simulation's in-memory Grid. A real
        SuperLink serves each pull as a request: polled every 0.02 s, it and the ServerApp
        spent about 0.2 and 0.14 of a core on a 3-node run. So each idle wait is twice the
        last, up to IDLE_POLL_MAX_SECONDS, until a reply comes in or a task goes out."""
        if not self.simulated:
            longest = max(seconds, IDLE_POLL_MAX_SECONDS)
            seconds = min(seconds * 2.0 ** min(self.quiet_waits, 30), longest)
            self.quiet_waits += 1
        time.sleep(seconds)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        """Replies to `msg_ids` ready now: those earlier pulls have brought in, and a fresh
        pull's (waited for up to `pull_wait`) of the ids no recent pull asks for yet."""
        wanted = set(msg_ids)
        self._gather()
        fresh = wanted - self.ready.keys() - self._recently_pulled()
        if fresh:
            pull = Pull(self.grid, sorted(fresh))
            self.pulls.append(pull)
            pull.done.wait(self.pull_wait)
            self._gather()
        claimed = [msg_id for msg_id in self.ready if msg_id in wanted]
        replies = [self.ready.pop(msg_id)[1] for msg_id in claimed]
        now = time.monotonic()
        self.delivered.update((r.msg_id, now) for r in replies if r.error_code is None)
        if replies:
            self.quiet_waits = 0
        return replies

    def _recently_pulled(self) -> set[str]:
        """Ids a running pull younger than `pull_wait` asks for: not pulled twice at once."""
        now = time.monotonic()
        young = [p for p in self.pulls if now - p.started < self.pull_wait]
        return set().union(*(p.ids for p in young))

    def _gather(self) -> None:
        """Move finished pulls' replies into `ready` (real replies first, errors as the class
        says), release held errors no running pull can overrule any more, and drop replies
        nobody asked for within UNCLAIMED_SECONDS."""
        finished, running = [], []
        for pull in self.pulls:
            (finished if pull.done.is_set() else running).append(pull)
        self.pulls = running
        for pull in running:
            self._report_slow(pull)
        now = time.monotonic()
        if self.stalled_since is not None and not any(p.reported for p in running):
            log.warning("reply pulls answer again after a %.0f s stall", now - self.stalled_since)
            self.stalled_since = None
        replies = [reply for pull in finished for reply in pull.result()]
        for reply in sorted(replies, key=lambda r: r.error_code is not None):
            self._take(reply, now, running)
        covered = set().union(*(p.ids for p in running))
        for msg_id in [m for m in self.held if m not in covered]:
            self.ready[msg_id] = (now, self.held.pop(msg_id))
        self._forget(now, running)

    def _take(self, reply: Reply, now: float, running: list[Pull]) -> None:
        msg_id = reply.msg_id
        pending = self.ready.get(msg_id)
        if reply.error_code is None:
            if self.held.pop(msg_id, None) is not None or pending is not None:
                self._overlap_dropped(msg_id)
            self.ready[msg_id] = (now, reply)
        elif msg_id in self.delivered or (pending and pending[1].error_code is None):
            self._overlap_dropped(msg_id)
        elif any(msg_id in p.ids for p in running):
            self.held[msg_id] = reply  # the pull still running may bring the real reply
        elif pending is None:
            self.ready[msg_id] = (now, reply)

    def _overlap_dropped(self, msg_id: str) -> None:
        """Said once per id: each later pull of the same id brings the same error again."""
        if msg_id not in self.overlaps_said:
            self.overlaps_said.add(msg_id)
            log.info("an overlapping pull's error reply to %s dropped: its reply is in", msg_id)

    def _forget(self, now: float, running: list[Pull]) -> None:
        """Drop replies unclaimed for UNCLAIMED_SECONDS, and delivered ids that no running
        pull started before their delivery (only such a pull can bring an error for one)."""
        for msg_id in [m for m, (at, _) in self.ready.items() if now - at > UNCLAIMED_SECONDS]:
            _, reply = self.ready.pop(msg_id)
            if reply.error_code is None:
                log.warning("dropped the reply to message %s: nothing asked for it", msg_id)
        oldest = min((p.started for p in running), default=math.inf)
        for msg_id in [m for m, at in self.delivered.items() if at < oldest]:
            del self.delivered[msg_id]

    def _report_slow(self, pull: Pull) -> None:
        """One line per stall (a paused SuperLink holds every pull): said at its first slow
        pull, and again when no slow pull runs any more."""
        if pull.reported:
            return
        pull.reported = True
        if self.stalled_since is not None:
            return
        self.stalled_since = pull.started
        log.warning(
            "a reply pull has run %.0f s (a busy SuperLink, or a node that died while "
            "uploading); the run goes on and its replies count when it finishes (said once "
            "until the pulls answer again)",
            time.monotonic() - pull.started,
        )
