"""GridTransport's pulls: a pull stuck on a reply whose upload never completes must not hold
up the replies of other clients, and late replies reach whoever asks for them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import numpy as np
import pytest

from fedstale.server_app import transport
from fedstale.server_app.transport import GridTransport, Reply


class UploadGrid:
    """Pulls like the SuperLink: a pull takes every finished reply it asks for (and removes
    it), then waits until the objects of each are uploaded; `stalled` uploads wait on
    `resume`, as a node that died mid-upload does until its push session expires."""

    def __init__(self) -> None:
        self.finished: set[str] = set()
        self.stalled: set[str] = set()
        self.resume = threading.Event()
        self.lock = threading.Lock()

    def pull_messages(self, msg_ids: Iterable[str]) -> list[str]:
        with self.lock:
            taken = sorted(self.finished & set(msg_ids))
            self.finished -= set(taken)
        if self.stalled & set(taken):
            self.resume.wait(10)
        return taken


class FailingGrid:
    def pull_messages(self, msg_ids: Iterable[str]) -> list[str]:
        raise ConnectionError("SuperLink unreachable")


@pytest.fixture(autouse=True)
def plain_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake grid's messages are their ids."""
    monkeypatch.setattr(transport, "reply_from_message", lambda msg: Reply(msg))


def ids(replies: list[Reply]) -> list[str]:
    return [r.msg_id for r in replies]


def receive_until(link: GridTransport, wanted: list[str], count: int) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + 5
    while len(got) < count and time.monotonic() < deadline:
        got += ids(link.receive(wanted))
    return got


def test_a_stalled_upload_does_not_hold_up_other_replies(caplog: pytest.LogCaptureFixture) -> None:
    grid = UploadGrid()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    grid.finished, grid.stalled = {"a"}, {"a"}
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        assert link.receive(["a", "b"]) == []  # the pull that took "a" hangs
        grid.finished.add("b")
        started = time.monotonic()
        assert ids(link.receive(["a", "b"])) == ["b"]
        assert time.monotonic() - started < 1.0
        assert ids(link.receive(["a"])) == []
    assert sum("reply pull has run" in r.message for r in caplog.records) == 1
    grid.resume.set()
    assert receive_until(link, ["a"], 1) == ["a"]  # delivered when its pull finishes
    assert link.pulls == []


def test_a_late_reply_waits_for_the_caller_that_asked_for_it() -> None:
    grid = UploadGrid()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    grid.finished, grid.stalled = {"task-1"}, {"task-1"}
    assert link.receive(["task-1"]) == []
    grid.resume.set()
    grid.finished.add("query-7")
    assert receive_until(link, ["query-7"], 1) == ["query-7"]  # node queries get theirs only
    assert receive_until(link, ["task-1"], 1) == ["task-1"]  # its pull may still be ending


def test_unclaimed_replies_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "UNCLAIMED_SECONDS", 0.0)
    grid = UploadGrid()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    grid.finished, grid.stalled = {"retired"}, {"retired"}
    assert link.receive(["retired"]) == []
    grid.resume.set()
    while link.pulls:
        link.receive([])
        time.sleep(0.01)
    time.sleep(0.01)
    link.receive([])
    assert link.ready == {}


def test_a_failed_pull_raises_in_the_engine_thread() -> None:
    link = GridTransport(FailingGrid(), ttl=60)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError, match="unreachable"):
        link.receive(["a"])
    assert link.receive([]) == []  # reported once


def test_named_array_sets_round_trip_through_flower_records() -> None:
    from fedstale.common.records import decode_sets, message_content

    fresh = {"w": np.arange(3, dtype=np.float32)}
    stale = {"w": np.ones(3, dtype=np.float32)}
    content = message_content({"task-id": 1}, fresh, {"stale": stale}, {"num-examples": 3})
    assert sorted(content) == ["arrays", "arrays.stale", "config", "metrics"]
    decoded = decode_sets(content)
    assert list(decoded) == ["stale"] and np.array_equal(decoded["stale"]["w"], stale["w"])
