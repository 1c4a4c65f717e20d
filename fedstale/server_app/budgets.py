"""What the engine counts (tasks by how they ended, seconds per phase) and when a run has
spent its budget."""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from fedstale.common.config import BudgetSettings, RunConfig

log = logging.getLogger("fedstale")

TIME_BUDGET = "time budget"


@dataclass
class Counters:
    dispatched: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    superseded: int = 0
    late: int = 0  # accepted updates whose task had been written off (no longer lost)
    late_refused: dict[str, int] = field(default_factory=dict)  # reason -> late replies
    client_compute_seconds: float = 0.0


class Stopwatch:
    """Seconds the engine spends in each phase (where the overhead goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start


def time_budget(run: BudgetSettings) -> float:
    return run.max_virtual_time or math.inf


def wall_budget(run: BudgetSettings) -> float:
    """Seconds of wall clock the run may take in all, counted from its start (inf: no limit):
    `max-wall-seconds`, and on the wall clock `max-virtual-time` too."""
    budgets = [run.max_wall_seconds, run.max_virtual_time if run.clock == "wall" else 0.0]
    return min((b for b in budgets if b), default=math.inf)


def spent(
    run: BudgetSettings,
    version: int,
    accepted: int,
    wall_seconds: float,
    now: float,
    target_hit: bool,
) -> str:
    """Why the run stops now ("" while it goes on): versions, updates, wall seconds, the
    wall clock's time budget, or the target accuracy, in that order."""
    if run.max_versions and version >= run.max_versions:
        return f"version budget {run.max_versions}"
    if run.max_updates and accepted >= run.max_updates:
        return f"update budget {run.max_updates}"
    if run.max_wall_seconds and wall_seconds >= run.max_wall_seconds:
        return f"wall-time budget {run.max_wall_seconds:g} s"
    if run.clock == "wall" and now >= time_budget(run):
        return TIME_BUDGET
    if target_hit:
        return f"target accuracy {run.target_accuracy}"
    return ""


def warn_wait_against_budget(run: RunConfig, found: int) -> None:
    """Say before waiting when the wait for the clients still missing (`found` of
    `num-clients` have a node) could take half the run's wall-clock budget or more (the
    budget counts the wait)."""
    wanted, budget, wait = run.num_clients, wall_budget(run), run.node_wait_seconds
    if found >= wanted or wait < budget / 2:
        return
    left = max(budget - wait, 0.0)
    log.warning(
        "waiting up to %g s (node-wait-seconds) for %d clients (%d answered so far), but the "
        "run's wall-clock budget is %g s and counts the wait: if they are late, %g s are "
        "left to train; start every node first, lower node-wait-seconds or raise the budget",
        wait,
        wanted,
        found,
        budget,
        left,
    )
