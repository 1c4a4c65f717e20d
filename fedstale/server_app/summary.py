"""summary.json: what a finished run adds up to."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from fedstale.common.config import metric_name, score_key
from fedstale.server_app.engine import Engine
from fedstale.server_app.results import aulc
from fedstale.strategies.base import Topology


def summarize(engine: Engine, wall_seconds: float) -> dict[str, Any]:
    loop_seconds = time.monotonic() - (engine.loop_started or engine.wall_start)
    evals = engine.scores.done
    times = [e.virtual_time for e in evals]
    accuracies = [e.accuracy for e in evals]
    scored = [a for a in accuracies if math.isfinite(a)]  # a library run may score nothing
    key = score_key(engine.run.metric)
    return finite_or_null(
        {
            "strategy": engine.run.strategy,
            "evaluation": "per-client" if engine.scores.per_client else "global",
            # a run that never scored (a library run without evaluate_fn) names no metric
            "metric": metric_name(engine.run.metric) if scored else None,
            "stop_reason": engine.stop_reason,
            f"final_{key}": accuracies[-1],
            f"best_{key}": max(scored) if scored else None,
            "acc_std" if key == "accuracy" else f"{key}_std": (
                statistics.pstdev(scored) if scored else None
            ),
            "aulc_days": aulc(times, accuracies) if scored else None,
            **counts(engine, wall_seconds, loop_seconds),
            **cohorts_of(engine),
        }
    )


def cohorts_of(engine: Engine) -> dict[str, Any]:
    """`cohorts` where the run's tasks trained in cohorts (trainer=cohort): how many
    computations trained them, their mean and largest size in tasks (a grid's cohorts hold
    every run's waiting tasks), and how many there were of each size; in a grid also this
    run's own share (`own`: its tasks per computation, mean and largest, and the fraction of
    the tasks those computations trained that were its own)."""
    sizes = getattr(engine.federation.transport, "cohort_sizes", None)
    if sizes is None:
        return {}
    histogram = {str(size): sizes.count(size) for size in sorted(set(sizes))}
    cohorts: dict[str, Any] = {
        "count": len(sizes),
        "mean": mean_of(sizes),
        "largest": max(sizes, default=None),
        "sizes": histogram,
    }
    own = getattr(engine.federation.transport, "own_sizes", None)
    if own is not None and own != sizes:  # shared with other runs: a grid's pool
        share = round(sum(own) / sum(sizes), 4) if sum(sizes) else None
        cohorts["own"] = {"mean": mean_of(own), "largest": max(own, default=None), "share": share}
    return {"cohorts": cohorts}


def mean_of(sizes: list[int]) -> float | None:
    return round(sum(sizes) / len(sizes), 3) if sizes else None


def finite_or_null(value: Any) -> Any:
    """NaN and infinity as null: bare NaN is not JSON to strict readers (jq, browsers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value


def counts(engine: Engine, wall_seconds: float, loop_seconds: float) -> dict[str, Any]:
    evals, counters, strategy = engine.scores.done, engine.counters, engine.strategy
    return {
        "time_to_target": engine.scores.time_to_target,
        "virtual_time": evals[-1].virtual_time,
        "versions": engine.version,
        "updates_accepted": counters.accepted,
        "updates_rejected": counters.rejected,
        "updates_late": counters.late,  # of the accepted: their task had been written off
        "late_refused": dict(counters.late_refused),  # reason -> late replies the rule refused
        "tasks_lost": counters.failed,
        "tasks_superseded": counters.superseded,
        "tasks_in_flight": len(engine.tasks),  # dispatched, unanswered when the run stopped
        "downlinks": counters.dispatched,  # train messages: tasks, replacements, multicasts
        # replies to live or written-off tasks (superseded ones are dropped uncounted)
        "uplinks": counters.accepted + counters.rejected + sum(counters.late_refused.values()),
        "tasks_dispatched": counters.dispatched,
        "wall_seconds": wall_seconds,
        "loop_seconds": loop_seconds,
        "updates_per_second": counters.accepted / max(loop_seconds, 1e-9),
        # How soon work came back: seconds from the run's start (as wall_seconds), and when.
        "first_update_seconds": (
            wall_seconds - (time.monotonic() - engine.first_update_at)
            if engine.first_update_at is not None
            else None
        ),
        "first_update_unix_time": engine.first_update_time,
        "client_compute_seconds": counters.client_compute_seconds,
        "engine_seconds": {
            k: round(v, 3) for k, v in sorted(engine.standing.watch.seconds.items())
        },
        **(strategy.summary() if isinstance(strategy, Topology) else {}),
        **engine.stages.summary(),
    }
