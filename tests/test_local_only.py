"""Local-only training (docs/algorithms.md, PACE section) against values worked by hand, and
both new PACE baselines (local-only, the authors' pFedGraph-Async) in a short real run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.reproduce_pace import METHODS, PARTITIONS, PROTOCOL
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import (
    EVAL_PER_CLIENT,
    NoParams,
    View,
    evaluates,
    load_state,
    state_of,
)
from fedstale.strategies.local_only import LocalOnly
from fedstale.strategies.registry import STRATEGIES, load_config
from tests.helpers import run_config
from tests.test_pace import arrival, digits_run


def three_clients() -> LocalOnly:
    return LocalOnly(run_config(num_clients=3, concurrency=2), NoParams(), np.array([1.0, 0.0]))


def starts(rule: LocalOnly) -> list[list[float]]:
    """The model each client's next task starts from, as a dispatch sends it."""
    return [rule.assign(c, View()).models["arrays"].tolist() for c in range(3)]


def test_a_clients_next_task_starts_from_exactly_what_it_returned() -> None:
    local = three_clients()
    assert starts(local) == [[1.0, 0.0]] * 3  # everyone starts from the initial model
    outcome = local.on_update(arrival(0, [0.25, 0.5], arrivals=7), View())
    assert starts(local) == [[0.25, 0.5], [1.0, 0.0], [1.0, 0.0]]  # the others untouched
    assert local.model_of(0).tolist() == [0.25, 0.5]  # scored: its own model
    assert outcome.changed and outcome.records[0]["weight"] == 1.0
    assert outcome.supersede == [] and outcome.dispatch == []
    np.testing.assert_allclose(local.model, [(0.25 + 1 + 1) / 3, 0.5 / 3])  # the saved mean

    local.on_update(arrival(2, [3.0, -1.0], arrivals=0), View())
    local.on_update(arrival(0, [0.5, 0.75], arrivals=2), View())
    assert starts(local) == [[0.5, 0.75], [1.0, 0.0], [3.0, -1.0]]
    assert [local.model_of(c).tolist() for c in range(3)] == starts(local)


def test_staleness_plays_no_part() -> None:
    fresh, stale = three_clients(), three_clients()
    for client, theta in ((1, [2.0, 2.0]), (0, [0.5, 0.5]), (1, [4.0, 0.0])):
        fresh.on_update(arrival(client, theta, arrivals=0), View())
        stale.on_update(arrival(client, theta, arrivals=40), View())
    assert starts(fresh) == starts(stale) == [[0.5, 0.5], [4.0, 0.0], [1.0, 0.0]]


def test_state_round_trips_and_the_rule_is_registered_per_client() -> None:
    local = three_clients()
    local.on_update(arrival(1, [0.0, 2.0], arrivals=0), View())
    copy = three_clients()
    load_state(copy, state_of(local))
    assert starts(copy) == starts(local) == [[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]]
    assert STRATEGIES["local-only"] is LocalOnly
    assert evaluates(LocalOnly) == EVAL_PER_CLIENT


def reproduction_values(method: str) -> dict[str, Any]:
    return {**PROTOCOL, **PARTITIONS["dir0.1"], **METHODS[method]}


@pytest.mark.parametrize("method", ["local-only", "pfedgraph-async-authors"])
def test_the_pace_reproductions_config_takes_the_new_baselines(method: str) -> None:
    run, _ = load_config({**reproduction_values(method), "max-updates": 10})
    assert run.eval_target == "per-client"


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("local-only", {}), ("pfedgraph-async", {"pace-pfedgraph-style": "authors"})],
)
def test_the_new_baselines_run_in_process_scored_per_client(
    strategy: str, extra: dict[str, Any], tmp_path: Path
) -> None:
    values = {"strategy": strategy, "num-clients": 8, "concurrency": 3, "max-versions": 24}
    summary = digits_run(tmp_path, **values, **extra)
    assert summary["evaluation"] == "per-client"
    assert summary["updates_accepted"] == 24
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(row["clients"] == 8 for row in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
