"""PACE and pFedGraph-Async (docs/algorithms.md, PACE) against values worked by hand."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.local import local_transport
from fedstale.server_app.experiment import run_experiment
from fedstale.server_app.results import read_jsonl
from fedstale.strategies.base import InFlight, Update, View, load_state, state_of
from fedstale.strategies.pace import (
    PACE,
    PACEParams,
    PFedGraphAsync,
    multicast_group,
    project_to_simplex,
)
from fedstale.strategies.registry import load_config
from tests.helpers import run_config


def brute_force_projection(v: np.ndarray) -> np.ndarray:
    """argmin ||w - v|| over the simplex by trying every support: on a support S the
    minimiser is v_S - (sum v_S - 1) / |S|; keep the feasible one nearest to v."""
    best, best_distance = None, np.inf
    for size in range(1, len(v) + 1):
        for support in itertools.combinations(range(len(v)), size):
            w = np.zeros(len(v))
            idx = list(support)
            w[idx] = v[idx] - (v[idx].sum() - 1.0) / size
            if (w >= -1e-12).all() and np.linalg.norm(w - v) < best_distance:
                best, best_distance = w, np.linalg.norm(w - v)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_simplex_projection_equals_the_brute_force_qp(seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = rng.normal(0, 1.5, size=int(rng.integers(2, 6)))
    projected = project_to_simplex(v)
    np.testing.assert_allclose(projected, brute_force_projection(v), atol=1e-12)
    assert projected.min() >= 0 and projected.sum() == pytest.approx(1.0)


def test_simplex_projection_by_hand() -> None:
    # u = [1.25, .25, .25]: only the first passes u_j - (cumsum - 1) / j > 0; threshold .25
    np.testing.assert_allclose(project_to_simplex(np.array([1.25, 0.25, 0.25])), [1, 0, 0])
    np.testing.assert_allclose(project_to_simplex(np.array([0.2, 0.3, 0.5])), [0.2, 0.3, 0.5])


def arrival(client: int, theta: list[float], arrivals: int) -> Update:
    return Update(
        client=client,
        task_id=client,
        base_version=0,
        staleness=arrivals,
        num_examples=1,
        vector=np.asarray(theta, dtype=np.float32),
        arrivals=arrivals,
    )


def three_clients(ablation: str = "none") -> PACE:
    run = run_config(num_clients=3, concurrency=2)
    strategy = PACE(run, PACEParams(pace_ablation=ablation), np.array([1.0, 0.0]))
    strategy.bind_client_sizes(np.array([2.0, 1.0, 1.0]))  # p = [.5, .25, .25]
    return strategy


def test_two_arrivals_worked_by_hand() -> None:
    pace = three_clients()
    pace.on_update(arrival(0, [0.0, 1.0], arrivals=0), View())
    # cos(theta_0, phi) = [1, 0, 0]; p + .75 cos = [1.25, .25, .25] -> W_0 = [1, 0, 0]
    np.testing.assert_allclose(pace.graph[0], [1.0, 0.0, 0.0])
    # j = 1, 2: pi_j = [0], alpha = W_j0 / (W_jj + W_j0) = .5 / (.25 + .5); tau 0: no decay
    third = [1 / 3, 2 / 3]
    np.testing.assert_allclose(pace.phi, [[0, 1], third, third], rtol=1e-6)

    pace.on_update(arrival(1, [1.0, 1.0], arrivals=2), View())
    # cos(theta_1, phi) = [1/sqrt 2, 1, 3/sqrt 10]; all three stay in the support, so
    # W_1 = v - (sum v - 1) / 3
    v = np.array([0.5 + 0.75 / np.sqrt(2), 1.0, 0.25 + 0.75 * 3 / np.sqrt(10)])
    np.testing.assert_allclose(pace.graph[1], v - (v.sum() - 1) / 3, rtol=1e-6)
    # j = 0: W_01 = 0, unchanged. j = 2: pi_2 = [0, 1], alpha = W_21 / (W_22 + W_20 + W_21)
    # = .25 / (.25 + .5 + .25), times the decay (1 + 2)^-1.5
    alpha = 0.25 * 3**-1.5
    np.testing.assert_allclose(pace.phi[0], [0.0, 1.0])
    np.testing.assert_allclose(pace.phi[1], [1.0, 1.0])
    expected = np.array(third) + alpha * (np.ones(2) - np.array(third))
    np.testing.assert_allclose(pace.phi[2], expected, rtol=1e-6)
    assert list(pace.sequence_length) == [1, 0, 2]  # pi_0 = [1], pi_1 = [], pi_2 = [0, 1]
    assert pace.sequence_weight == pytest.approx([0.0, 0.0, 0.75])


def test_the_buffer_ablation_blends_without_the_staleness_decay() -> None:
    pace = three_clients("buffer")
    pace.on_update(arrival(0, [0.0, 1.0], arrivals=0), View())
    pace.on_update(arrival(1, [1.0, 1.0], arrivals=2), View())
    # alpha = .25 without the decay: [1/3, 2/3] + .25 ([1, 1] - [1/3, 2/3])
    np.testing.assert_allclose(pace.phi[2], [0.5, 0.75], rtol=1e-6)


def test_pfedgraph_async_sends_the_graph_mix_and_never_blends() -> None:
    run = run_config(num_clients=3, concurrency=2)
    naive = PFedGraphAsync(run, PACEParams(), np.array([1.0, 0.0]))
    naive.bind_client_sizes(np.array([2.0, 1.0, 1.0]))
    outcome = naive.on_update(arrival(0, [0.0, 1.0], arrivals=0), View())
    np.testing.assert_allclose(naive.phi, [[0, 1], [1, 0], [1, 0]])  # only phi_0 moved
    assert outcome.supersede == []
    # client 1 starts from sum_j W_1j phi_j with row 1 still p = [.5, .25, .25]
    np.testing.assert_allclose(naive.model_for(1), [0.5, 0.5])  # .5 [0, 1] + .5 [1, 0]
    np.testing.assert_allclose(naive.model_for(0), [0.0, 1.0])  # W_0 = [1, 0, 0]
    assert naive.model_of(1).tolist() == naive.model_for(1).tolist()


def authors_pfedgraph() -> PFedGraphAsync:
    run = run_config(num_clients=3, concurrency=2)
    naive = PFedGraphAsync(run, PACEParams(pace_pfedgraph_style="authors"), np.array([1.0, 0.0]))
    naive.bind_client_sizes(np.array([2.0, 1.0, 1.0]))  # p = [.5, .25, .25]
    return naive


def test_authors_pfedgraph_stores_each_clients_aggregate_worked_by_hand() -> None:
    naive = authors_pfedgraph()
    naive.on_update(arrival(0, [0.0, 1.0], arrivals=0), View())
    # cos(theta_0, phi) = [1, 0, 0] -> W_0 = [1, 0, 0]; phi_0 = 1 * theta_0
    np.testing.assert_allclose(naive.phi, [[0, 1], [1, 0], [1, 0]])
    # client 1 has no aggregate yet: it starts from its stored model, the initial one,
    # where the default sends the mix .5 [0, 1] + .5 [1, 0]
    assert naive.model_for(1).tolist() == [1.0, 0.0]
    assert naive.model_of(1).tolist() == [1.0, 0.0]

    naive.on_update(arrival(1, [1.0, 1.0], arrivals=5), View())
    # cos(theta_1, [phi_0, theta_1, phi_2]) = [1/sqrt 2, 1, 1/sqrt 2];
    # v = p + .75 cos = [1.0303, 1, .7803], all in the support: W_1 = v - (sum v - 1) / 3
    # = [.4268, .3964, .1768]; phi_1 = W_10 [0, 1] + W_11 [1, 1] + W_12 [1, 0]
    # = [W_11 + W_12, W_10 + W_11] = [.5732, .8232]
    s = 1 / np.sqrt(2)
    v = np.array([0.5 + 0.75 * s, 1.0, 0.25 + 0.75 * s])
    w1 = v - (v.sum() - 1) / 3
    np.testing.assert_allclose(naive.graph[1], w1, rtol=1e-9)
    stored = np.array([w1[1] + w1[2], w1[0] + w1[1]])
    np.testing.assert_allclose(naive.phi[1], stored, rtol=1e-6)
    np.testing.assert_allclose(stored, [0.5732, 0.8232], atol=1e-4)
    assert naive.model_for(1).tolist() == naive.phi[1].tolist()  # no mixing at dispatch
    np.testing.assert_allclose(naive.phi[[0, 2]], [[0, 1], [1, 0]])  # the others untouched

    naive.on_update(arrival(2, [1.0, 0.0], arrivals=1), View())
    # the similarity to client 1 is to its aggregate: cos([1, 0], [.5732, .8232]) = .5714
    # (to its raw [1, 1] it would be .7071); v = [.5 + 0, .25 + .75 * .5714, .25 + .75]
    # = [.5, .6786, 1], all in the support: W_2 = v - (sum v - 1) / 3 = [.1071, .2857, .6071]
    cos = stored[0] / np.linalg.norm(stored)
    v = np.array([0.5, 0.25 + 0.75 * cos, 1.0])
    w2 = v - (v.sum() - 1) / 3
    np.testing.assert_allclose(naive.graph[2], w2, rtol=1e-6)
    np.testing.assert_allclose(w2, [0.1071, 0.2857, 0.6071], atol=1e-4)
    expected = w2[0] * np.array([0.0, 1.0]) + w2[1] * stored + w2[2] * np.array([1.0, 0.0])
    np.testing.assert_allclose(naive.phi[2], expected, rtol=1e-6)
    np.testing.assert_allclose(naive.model, naive.phi.mean(axis=0), rtol=1e-6)


def test_authors_pfedgraph_is_refused_outside_the_naive_baseline() -> None:
    with pytest.raises(ConfigError, match="pace-pfedgraph-style=authors is a form of the naive"):
        load_config({"strategy": "pace", "pace-pfedgraph-style": "authors"})
    for values in (
        {"strategy": "pfedgraph-async"},
        {"strategy": "pace", "pace-ablation": "naive"},
    ):
        _, params = load_config({**values, "pace-pfedgraph-style": "authors"})
        assert params.pace_pfedgraph_style == "authors"


def test_multicast_takes_the_shortest_prefix_over_omega() -> None:
    taus = [(50, 3, 30), (10, 1, 10), (50, 2, 20)]  # (tau, client, task)
    assert multicast_group(taus, 2500.0) == [20, 30]  # 2500 is not > 2500; ties: lower id
    assert multicast_group(taus, 4999.0) == [20, 30]
    assert multicast_group(taus, 5000.0) == [20, 30, 10]
    assert multicast_group(taus, 5100.0) == []


def test_an_arrival_supersedes_the_stalest_tasks_and_resends_their_buffers() -> None:
    run = run_config(num_clients=4, concurrency=3)
    pace = PACE(run, PACEParams(pace_omega=50.0, pace_multicast_max=2), np.zeros(2))
    in_flight = (InFlight(7, 2, 0, 9, 6), InFlight(8, 3, 0, 9, 1))  # taus after: 7, 2
    outcome = pace.on_update(arrival(0, [1.0, 0.0], arrivals=0), View(1, (1,), in_flight, 1))
    assert outcome.supersede == [7, 8]  # 7^2 = 49 is not > 50; 49 + 2^2 = 53 is: both
    assert [a.client for a in outcome.dispatch] == [2, 3]  # restarted from their buffers
    np.testing.assert_array_equal(outcome.dispatch[0].models["arrays"], pace.phi[2])


def test_multicast_beyond_its_cap_is_skipped() -> None:
    run = run_config(num_clients=4, concurrency=3)
    pace = PACE(run, PACEParams(pace_omega=50.0, pace_multicast_max=1), np.zeros(2))
    in_flight = (InFlight(7, 2, 0, 9, 6), InFlight(8, 3, 0, 9, 1))
    outcome = pace.on_update(arrival(0, [1.0, 0.0], arrivals=0), View(1, (1,), in_flight, 1))
    assert outcome.supersede == [] and outcome.dispatch == []


def test_state_round_trips() -> None:
    pace = three_clients()
    pace.on_update(arrival(0, [0.0, 1.0], arrivals=0), View())
    copy = three_clients()
    load_state(copy, state_of(pace))
    np.testing.assert_array_equal(copy.phi, pace.phi)
    np.testing.assert_array_equal(copy.graph, pace.graph)
    assert copy.last_arrival == 0


def test_same_client_dispatch_sends_the_arrival_back_first() -> None:
    run = run_config(num_clients=4, concurrency=2)
    pace = PACE(run, PACEParams(pace_dispatch="same-client"), np.zeros(2))
    pace.on_update(arrival(2, [1.0, 0.0], arrivals=0), View())
    plan = pace.plan(View(1, (0, 2, 3), (), 1), np.random.default_rng(0))
    assert [a.client for a in plan] == [2]
    np.testing.assert_array_equal(plan[0].models["arrays"], pace.phi[2])
    assert plan[0].settings == {"momentum": 0.9, "weight_decay": 1e-4}
    assert plan[0].entries == {"pace-lambda": 0.01}


def digits_run(runs_dir: Path, **values: Any) -> dict[str, Any]:
    """A short in-process run of a personalised rule on digits, split per-class Dirichlet
    0.3 with a local test split per client; its summary (folder `runs_dir`/run)."""
    values = {
        "dataset": "digits",
        "partition": "dirichlet",
        "dirichlet-convention": "per-class",
        "dirichlet-alpha": 0.3,
        "test-split": "local",
        "client-val-fraction": 0.25,
        "lr": 0.05,
        "local-epochs": 1,
        "max-virtual-time": 0.0,
        "eval-interval": 500.0,
        "run-name": "run",
        "runs-dir": str(runs_dir),
        **values,
    }
    run, params = load_config(values)
    return run_experiment(run, params, local_transport(run))


def test_pace_runs_in_process_with_multicasts_and_personal_evaluation(tmp_path: Path) -> None:
    values = {
        "strategy": "pace",
        "num-clients": 12,
        "concurrency": 4,
        "latency": "slow-fraction",
        "max-versions": 60,
        "pace-omega": 20.0,
        "run-name": "pace",
    }
    summary = digits_run(tmp_path, **values)
    assert summary["evaluation"] == "per-client"
    assert summary["tasks_superseded"] > 0  # multicasts happened
    assert summary["downlinks"] == summary["tasks_dispatched"]
    assert summary["uplinks"] == summary["updates_accepted"] == 60
    rows = read_jsonl(tmp_path / "pace" / "metrics.jsonl")
    assert all(row["clients"] == 12 for row in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.2
    updates = read_jsonl(tmp_path / "pace" / "updates.jsonl")
    assert sum(row["multicast"] for row in updates) == summary["tasks_superseded"]
