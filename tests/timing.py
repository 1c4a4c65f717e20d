"""Each test's time bound, from what it measured: tests/durations.json holds every test's
seconds (setup, call and teardown; the slowest of the runs recorded into it) and the
one-time costs some test pays first (the wheel's virtualenvs, the container images). A test
gets `margin` times its own measure (at least `floor` seconds), plus the measure of each
one-time cost it pays; past that its process gets SIGALRM and the test fails with one line
naming the bound, its `finally` blocks and fixtures stopping what it started. A test not
measured yet gets the largest bound of the table, and the session's summary names it.

Record with `make durations` (or `pytest --record-durations PATH`): each test's time is
merged into PATH by its maximum, so a table measured quiet and then beside a second suite
holds the slower of the two."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")
TABLE_ENV = "FEDSTALE_TEST_DURATIONS"  # another table (the tests of this module use one)
ONE_TIME_PROPERTY = "one-time-cost"
# A new table's margin over each measure, and the least bound: a test measured at 8 s took
# over 60 s at nice 19 beside two whole suites (its setup, which pytest's JUnit report left
# out of the first table, included).
MARGIN, FLOOR = 4.0, 120.0


class OverTimeBound(BaseException):  # not an Exception: no `except Exception` swallows it
    """A test ran past the bound its measured time gives it."""


@dataclass
class Table:
    margin: float
    floor: float
    tests: dict[str, float] = field(default_factory=dict)
    once: dict[str, float] = field(default_factory=dict)
    measured: list[str] = field(default_factory=list)  # where and how each recording ran

    @classmethod
    def read(cls, path: Path) -> Table:
        return cls(**json.loads(path.read_text()))

    def bound(self, key: str) -> float | None:
        """`key`'s bound in seconds; None where it was never measured."""
        seconds = self.tests.get(key)
        return None if seconds is None else self.bounded(seconds)

    def bounded(self, seconds: float) -> float:
        return max(self.floor, self.margin * seconds)

    def largest(self) -> float:
        return max(map(self.bound, self.tests), default=self.floor)  # type: ignore[arg-type]

    def once_bound(self, name: str) -> float:
        seconds = self.once.get(name)
        return self.largest() if seconds is None else self.bounded(seconds)


def key(nodeid: str) -> str:
    """A test's name in the table: pytest-xdist's `@group` suffix dropped."""
    return re.sub(r"@[\w-]+$", "", nodeid)


def table() -> Table:
    """The table this process bounds its tests by, read once (it changes only when a
    session records into it, at its end)."""
    return _read(Path(os.environ.get(TABLE_ENV, TABLE)))


@functools.cache
def _read(path: Path) -> Table:
    return Table.read(path)


@dataclass
class _Armed:
    properties: list[tuple[str, object]]  # the test's user_properties: its reports carry them
    bound: float
    deadline: float
    said: str


_ARMED: _Armed | None = None


def arm(nodeid: str, properties: list[tuple[str, object]]) -> None:
    """Start `nodeid`'s clock: SIGALRM at its bound."""
    global _ARMED
    found = table()
    bound = found.bound(key(nodeid))
    if bound is None:
        bound, said = found.largest(), "not measured yet: the table's largest bound"
    else:
        said = f"{found.margin:g} x its measured {found.tests[key(nodeid)]:.1f} s"
    _ARMED = _Armed(properties, bound, time.monotonic() + bound, said)
    signal.signal(signal.SIGALRM, _over)
    signal.setitimer(signal.ITIMER_REAL, bound)


def disarm() -> None:
    global _ARMED
    signal.setitimer(signal.ITIMER_REAL, 0)
    _ARMED = None


def own_session_env(**extra: str) -> dict[str, str]:
    """The environment for a pytest session a test starts: this one's without
    PYTEST_ADDOPTS, whose options (a JUnit file, --record-durations) are the outer
    session's: the inner one would overwrite its files and record its own tests there."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, **extra}


def deploy_timeout() -> str:
    """`fedstale deploy --timeout` for a test's deployment: it stops itself (and its
    SuperLink and SuperNodes) 30 s before the test's bound would."""
    return f"{max(30.0, left() - 30.0):.0f}"


def left() -> float:
    """Seconds left to the running test (for a timeout inside it); an hour outside one."""
    return 3600.0 if _ARMED is None else max(1.0, _ARMED.deadline - time.monotonic())


@contextlib.contextmanager
def one_time(name: str) -> Iterator[None]:
    """A cost paid once by whichever test needs it first (the wheel's virtualenvs): its own
    measured bound is added to that test's, and its seconds are recorded apart."""
    started = time.monotonic()
    if _ARMED is not None:
        extra = table().once_bound(name)
        _ARMED.deadline += extra
        _ARMED.bound += extra
        _ARMED.said += f", plus {extra:.0f} s for {name}"
        signal.setitimer(signal.ITIMER_REAL, max(0.001, _ARMED.deadline - time.monotonic()))
    try:
        yield
    finally:
        if _ARMED is not None:
            _ARMED.properties.append((ONE_TIME_PROPERTY, (name, time.monotonic() - started)))


def _over(signum: int, frame: object) -> None:
    armed = _ARMED
    said = f"{armed.bound:.0f} s ({armed.said})" if armed else "its bound"
    raise OverTimeBound(
        f"ran past its time bound of {said}: a hang, or it grew on purpose "
        "(then record it again: make durations)"
    )


def record(path: Path, measured: dict[str, float], once: dict[str, float], note: str) -> None:
    """Merge one run's seconds into the table at `path` by their maximum (under a lock:
    two suites may finish at once)."""
    folder = os.open(path.parent, os.O_RDONLY)  # the lock: no file of its own is left
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        old = Table.read(path) if path.exists() else Table(MARGIN, FLOOR)
        for mine, theirs in ((old.tests, measured), (old.once, once)):
            for name, seconds in theirs.items():
                mine[name] = round(max(mine.get(name, 0.0), seconds), 1)
        old.tests, old.once = dict(sorted(old.tests.items())), dict(sorted(old.once.items()))
        old.measured.append(note)
        path.write_text(json.dumps(old.__dict__, indent=1) + "\n")
    finally:
        os.close(folder)
