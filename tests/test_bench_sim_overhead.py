"""bench.sim_overhead's per-update breakdown, on summaries worked by hand."""

from __future__ import annotations

import math

from bench.sim_overhead import breakdown


def test_a_run_that_waited_splits_its_wait_beyond_the_clients_compute() -> None:
    row = breakdown(
        {
            "updates_accepted": 2,
            "loop_seconds": 12.2,
            "client_compute_seconds": 10.0,
            "engine_seconds": {"idle": 12.0, "pull": 0.2},
        }
    )
    assert row["wall"] == 6100.0 and row["client compute"] == 5000.0
    assert row["pull"] == 100.0
    assert row["waited beyond compute"] == 1000.0  # (12.0 s idle - 10.0 s compute) / 2


def test_an_in_process_run_has_no_wait_to_split() -> None:
    row = breakdown(
        {
            "updates_accepted": 2,
            "loop_seconds": 10.2,
            "client_compute_seconds": 10.0,
            "engine_seconds": {"dispatch": 10.0},  # --local trains inside dispatch
        }
    )
    assert row["dispatch"] == 5000.0
    assert math.isnan(row["waited beyond compute"])
