"""The two clocks behind one interface.

- Virtual: a task finishes at dispatch time + the client's latency from its profile, and
  completions are handled strictly in (finish time, task id) order: the engine waits for
  the earliest-finishing task's reply even if later ones have arrived. A seed therefore
  gives the same run on any machine.
- Wall: replies are handled in the order they arrive; virtual time is elapsed seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Task:
    """A task in flight: `version` the global version it started from, `accepted_before`
    the updates accepted before it was sent, `deadline` the monotonic second after which
    it is retired unanswered (inf: none), `sets` the named array sets it carried beyond the
    main one."""

    task_id: int
    client: int
    node: int
    msg_id: str
    version: int
    accepted_before: int
    dispatched_at: float
    finishes_at: float
    deadline: float = math.inf
    sets: tuple[str, ...] = ()


class Clock(Protocol):
    def now(self) -> float: ...

    def finish_time(self, latency: float) -> float: ...

    def next_ready(self, tasks: Mapping[int, Task], arrived: Mapping[int, object]) -> Task | None:
        """The task to handle next, or None to wait for more replies."""
        ...

    def completion_time(self, task: Task) -> float:
        """When the task counts as finished on this clock."""
        ...

    def advance(self, task: Task) -> None: ...

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the clock's reading."""
        ...

    def load_state(self, state: dict[str, float]) -> None: ...


class VirtualClock:
    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def finish_time(self, latency: float) -> float:
        return self.time + latency

    @staticmethod
    def earliest(tasks: Mapping[int, Task]) -> Task | None:
        return min(tasks.values(), key=lambda t: (t.finishes_at, t.task_id), default=None)

    def next_ready(self, tasks: Mapping[int, Task], arrived: Mapping[int, object]) -> Task | None:
        head = self.earliest(tasks)
        return head if head is not None and head.task_id in arrived else None

    def completion_time(self, task: Task) -> float:
        return task.finishes_at

    def advance(self, task: Task) -> None:
        self.time = max(self.time, task.finishes_at)

    def state(self) -> dict[str, float]:
        return {"time": self.time}

    def load_state(self, state: dict[str, float]) -> None:
        self.time = state["time"]


class WallClock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.start

    def finish_time(self, latency: float) -> float:
        return math.inf

    def next_ready(self, tasks: Mapping[int, Task], arrived: Mapping[int, object]) -> Task | None:
        first = next(iter(arrived), None)
        return None if first is None else tasks[first]  # type: ignore[index]

    def completion_time(self, task: Task) -> float:
        return self.now()

    def advance(self, task: Task) -> None:
        """Wall time advances by itself."""

    def state(self) -> dict[str, float]:
        return {"time": self.now()}

    def load_state(self, state: dict[str, float]) -> None:
        """Go on counting from the saved reading."""
        self.start = time.monotonic() - state["time"]


def make_clock(kind: str) -> Clock:
    return VirtualClock() if kind == "virtual" else WallClock()
