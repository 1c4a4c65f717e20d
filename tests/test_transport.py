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


class RacingGrid:
    """The SuperLink's pull: the first pull of an id whose reply is in takes it and deletes
    it; a later pull of that id gets an error reply (code 3, "Message Unavailable"). Pull
    number k (from 0) answers only once `gates[k]` is set, when the test gives it one."""

    def __init__(self, finished: set[str]) -> None:
        self.finished = set(finished)
        self.taken: set[str] = set()
        self.gates: dict[int, threading.Event] = {}
        self.calls: list[list[str]] = []
        self.lock = threading.Lock()

    def pull_messages(self, msg_ids: Iterable[str]) -> list[Reply]:
        with self.lock:
            asked = sorted(msg_ids)
            number = len(self.calls)
            self.calls.append(asked)
            took = sorted(self.finished & set(asked))
            gone = sorted(self.taken & set(asked))
            self.finished -= set(took)
            self.taken |= set(took)
        gate = self.gates.get(number)
        if gate is not None:
            gate.wait(10)
        unavailable = [Reply(m, error_code=3, error="Message Unavailable") for m in gone]
        return [Reply(m) for m in took] + unavailable


@pytest.fixture(autouse=True)
def plain_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake grids' messages are their ids, or their replies already."""
    monkeypatch.setattr(
        transport, "reply_from_message", lambda msg: msg if isinstance(msg, Reply) else Reply(msg)
    )


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
        assert time.monotonic() - started < 5.0  # blocked, it would wait out the 10 s stall
        assert ids(link.receive(["a"])) == []
    assert sum("reply pull has run" in r.message for r in caplog.records) == 1
    grid.resume.set()
    assert receive_until(link, ["a"], 1) == ["a"]  # delivered when its pull finishes
    assert link.pulls == []


def test_a_stall_of_every_pull_is_said_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A paused SuperLink holds every pull: one deployment printed the slow-pull warning 57
    times. One line when the stall begins, one when the pulls answer again."""
    grid = UploadGrid()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    grid.finished, grid.stalled = {"a", "b", "c"}, {"a", "b", "c"}
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        for wanted in (["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c"]):
            assert link.receive(wanted) == []  # each new id a new pull, each held
        grid.resume.set()
        assert sorted(receive_until(link, ["a", "b", "c"], 3)) == ["a", "b", "c"]
        link.receive([])
    said = [r.getMessage() for r in caplog.records]
    assert sum("reply pull has run" in line for line in said) == 1, said
    assert sum("reply pulls answer again" in line for line in said) == 1, said


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


def collect(link: GridTransport, wanted: list[str], seconds: float) -> list[Reply]:
    """Every reply `receive` hands out over `seconds`."""
    got: list[Reply] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += link.receive(wanted)
        time.sleep(0.01)
    return got


def receive_replies_until(link: GridTransport, wanted: list[str], awaited: str) -> list[Reply]:
    """What `receive` hands out until a reply to `awaited` comes (a caller then stops
    asking for it)."""
    got: list[Reply] = []
    deadline = time.monotonic() + 5
    while awaited not in ids(got) and time.monotonic() < deadline:
        got += link.receive(wanted)
    return got


def test_an_error_from_an_overlapping_pull_never_costs_the_reply_it_raced() -> None:
    """The first pull takes "a" and hangs (a stalled SuperLink); the second pull of "a",
    started once the first has run the pull wait, is answered with an error first. The
    error is held, and the real reply is handed out when the first pull ends."""
    grid = RacingGrid({"a"})
    first = grid.gates[0] = threading.Event()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    assert link.receive(["a", "b"]) == []
    assert collect(link, ["a", "b"], 0.3) == []  # the second pull's error is not handed out
    assert len(grid.calls) >= 2 and all(call == ["a", "b"] for call in grid.calls)
    first.set()
    got = receive_replies_until(link, ["a", "b"], "a")
    assert [(r.msg_id, r.error_code) for r in got] == [("a", None)]
    assert link.held == {}


def test_a_real_reply_wins_when_both_pulls_end_before_the_same_gather() -> None:
    grid = RacingGrid({"a"})
    gates = [grid.gates.setdefault(k, threading.Event()) for k in (0, 1)]
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    assert link.receive(["a"]) == []
    time.sleep(0.06)
    assert link.receive(["a"]) == []  # a second pull of "a": it will get the error
    for gate in reversed(gates):  # the error's pull ends first
        gate.set()
    for pull in link.pulls:
        assert pull.done.wait(5)
    got = link.receive(["a"])
    assert [(r.msg_id, r.error_code) for r in got] == [("a", None)]


def test_an_error_arriving_after_its_reply_was_handed_out_is_dropped() -> None:
    grid = RacingGrid({"a"})
    late_error = grid.gates[1] = threading.Event()
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    grid.gates[0] = threading.Event()
    assert link.receive(["a"]) == []
    time.sleep(0.06)
    assert link.receive(["a"]) == []  # the second pull hangs too
    grid.gates[0].set()
    got = receive_replies_until(link, ["a"], "a")
    assert [(r.msg_id, r.error_code) for r in got] == [("a", None)]
    late_error.set()
    assert collect(link, [], 0.2) == []
    assert link.ready == {} and link.delivered == {}


def test_a_genuine_error_is_handed_out_once_no_pull_can_overrule_it() -> None:
    grid = RacingGrid(set())
    grid.taken.add("expired")  # the SuperLink answers every pull of it with an error
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    got = link.receive(["expired"])
    assert [(r.msg_id, r.error_code) for r in got] == [("expired", 3)]


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


def test_an_overlapping_pulls_error_is_said_once_per_id(caplog: pytest.LogCaptureFixture) -> None:
    """Every later pull of an id already answered brings the same error: one line per id."""
    grid = RacingGrid({"a"})
    link = GridTransport(grid, ttl=60, pull_wait=0.05)  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, logger="fedstale")
    for msg_id in ("a", "a", "b", "a"):
        link._overlap_dropped(msg_id)
    said = [r.getMessage() for r in caplog.records if "overlapping pull" in r.getMessage()]
    assert len(said) == 2 and "to a dropped" in said[0] and "to b dropped" in said[1]


class PushGrid(UploadGrid):
    def push_messages(self, messages: list) -> list[str]:
        return ["sent"]


class InMemoryGrid(PushGrid):
    """Named as Flower simulation's Grid, which the transport polls at the engine's pace."""


def test_idle_polls_of_a_real_superlink_back_off_until_a_reply_or_a_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    monkeypatch.setattr(transport, "Message", lambda *_, **__: None)  # no Flower run here
    grid = PushGrid()
    link = GridTransport(grid, ttl=60, pull_wait=1.0)  # type: ignore[arg-type]
    for _ in range(6):
        link.wait(0.02)
    assert slept == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.25, 0.25])
    grid.finished.add("a")
    assert ids(link.receive(["a"])) == ["a"]
    link.wait(0.02)
    link.wait(0.02)
    link.send(7, "train", {})
    link.wait(0.02)
    assert slept[6:] == pytest.approx([0.02, 0.04, 0.02])
    link.wait(0.5)  # a poll-interval above the cap is kept
    assert slept[-1] == 0.5

    slept.clear()
    simulated = GridTransport(InMemoryGrid(), ttl=60)  # type: ignore[arg-type]
    for _ in range(4):
        simulated.wait(0.02)
    assert slept == [0.02] * 4
