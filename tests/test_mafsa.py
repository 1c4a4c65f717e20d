"""MAFSA's math (docs/algorithms.md, MAFSA) against values worked by hand."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedstale.client_app.task import client_model, train_task
from fedstale.common.config import ConfigError
from fedstale.common.federation import FederationKey
from fedstale.common.models import get_flat, set_flat
from fedstale.common.schema import ARRAYS, STALE, TaskSpec
from fedstale.common.shares import client_data
from fedstale.common.threads import limited
from fedstale.common.training import local_train
from fedstale.launcher.local import local_transport
from fedstale.server_app.experiment import run_experiment
from fedstale.strategies import hierarchy as h
from fedstale.strategies import mafsa as m
from fedstale.strategies.base import Outcome, Update, View, load_state, state_of
from fedstale.strategies.hierarchy import Hierarchy
from fedstale.strategies.registry import build_strategy, load_config
from tests.helpers import run_config


def test_beta_for_a_given_mean_staleness() -> None:
    # E = [0, 1, 3]: E_avg over the returning clients = 2; beta = ln(2) / 2
    assert h.beta_for([0, 1, 3]) == pytest.approx(math.log(2) / 2)
    assert h.beta_for([0, 0]) == 0.0
    assert h.alpha_for(0, 0.3) == 1.0
    assert h.alpha_for(2, math.log(2) / 2) == pytest.approx(0.5)  # exp(-ln 2)


def test_one_edge_aggregation_with_a_returning_client() -> None:
    fresh = [np.array([1.0, 0.0], dtype=np.float32), np.array([3.0, 2.0], dtype=np.float32)]
    stale = [None, np.array([7.0, 6.0], dtype=np.float32)]
    # client 2 was away E = 2 rounds: E_avg 2, beta ln(2)/2, alpha 0.5:
    # blended 0.5 [3, 2] + 0.5 [7, 6] = [5, 4]; theta = (100 [1, 0] + 300 [5, 4]) / 400
    theta, alphas, beta = h.edge_aggregate(fresh, stale, [100, 300], [0, 2])
    assert alphas == pytest.approx([1.0, 0.5]) and beta == pytest.approx(math.log(2) / 2)
    np.testing.assert_allclose(theta, [4.0, 3.0], rtol=1e-6)


def test_the_delta_and_mix_cloud_steps() -> None:
    w = np.array([1.0, 1.0], dtype=np.float32)
    theta = np.array([3.0, 0.0], dtype=np.float32)
    base = np.array([2.0, 1.0], dtype=np.float32)  # what the edge started from
    # delta: w + 0.25 ([3, 0] - [2, 1]) = [1.25, 0.75]; mix: 0.75 w + 0.25 theta = [1.5, 0.75]
    np.testing.assert_allclose(m.cloud_step(w, theta, base, 0.25, "delta"), [1.25, 0.75])
    np.testing.assert_allclose(m.cloud_step(w, theta, base, 0.25, "mix"), [1.5, 0.75])


def test_the_dropout_schedule_is_seeded_and_rule_independent() -> None:
    pattern = [[h.online(c, r, 0.3, seed=7) for r in range(50)] for c in range(20)]
    again = [[h.online(c, r, 0.3, seed=7) for r in range(50)] for c in range(20)]
    assert pattern == again  # a function of (seed, client, round) only
    share = 1 - np.mean(pattern)
    assert 0.25 < share < 0.35  # 1,000 draws at p = 0.3
    assert all(h.online(c, r, 0.0, seed=7) for c in range(5) for r in range(5))
    assert pattern != [[h.online(c, r, 0.3, seed=8) for r in range(50)] for c in range(20)]


def test_edge_groups_are_equal_seeded_and_cover_every_client() -> None:
    groups = h.edge_groups(100, 5, seed=3)
    assert [len(g) for g in groups] == [20] * 5
    assert sorted(c for g in groups for c in g) == list(range(100))
    assert groups == h.edge_groups(100, 5, seed=3) != h.edge_groups(100, 5, seed=4)
    assert [len(g) for g in h.edge_groups(7, 3, seed=0)] == [3, 2, 2]


# ------------------------------------------------------------------ the rules' rounds
def hierarchy(
    name: str, *, p: float = 0.0, rule: str = "delta", edges: int = 2, **run: Any
) -> Hierarchy:
    values = {
        "strategy": name,
        "num-clients": 4,
        "concurrency": 4,
        "mafsa-edges": edges,
        "mafsa-cloud-rule": rule,
        "mafsa-dropout-rate": p,
        "local-steps": 5,
        "batch-size": 10,
        "lr": 0.1,
        "lr-decay": 0.5,
        "seed": 3,
        **{key.replace("_", "-"): value for key, value in run.items()},
    }
    config, params = load_config(values)
    strategy = build_strategy(config, params, np.zeros(2, dtype=np.float32))
    assert isinstance(strategy, Hierarchy)
    strategy.bind_client_sizes(np.full(config.num_clients, 10.0))
    return strategy


def reply(strategy: Hierarchy, client: int, vector: list[float], n: int, **sets: Any) -> Outcome:
    done = Update(client, 0, 0, 0, n, np.array(vector, dtype=np.float32), sets=sets)
    return strategy.on_update(done, View())


def test_mafsa_cloud_moves_at_each_edge_upload_by_hand() -> None:
    for rule, expected in (("delta", [2.0, 2.0]), ("mix", [1.75, 1.25])):
        strategy = hierarchy("mafsa", rule=rule)
        (a, b), (c, d) = (edge.clients for edge in strategy.edges)
        plan = strategy.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0))
        assert sorted(x.client for x in plan) == [0, 1, 2, 3]
        assert all(np.array_equal(x.models[ARRAYS], [0, 0]) for x in plan)
        # edge 0: theta = (1 [4, 0] + 3 [0, 4]) / 4 = [1, 3]; rho = 1/2 (equal sizes):
        # w = [0, 0] + 0.5 ([1, 3] - [0, 0]) = [0.5, 1.5] (delta and mix alike here)
        assert not reply(strategy, a, [4, 0], 1).changed
        outcome = reply(strategy, b, [0, 4], 3)
        assert outcome.changed and [r["weight"] for r in outcome.records] == [0.25, 0.75]
        np.testing.assert_allclose(strategy.model, [0.5, 1.5])
        # edge 1 started from [0, 0]: theta = [3, 1]; delta: w + 0.5 ([3, 1] - [0, 0]) =
        # [2, 2]; mix: 0.5 [0.5, 1.5] + 0.5 [3, 1] = [1.75, 1.25]
        reply(strategy, c, [2, 2], 1)
        assert reply(strategy, d, [4, 0], 1).changed
        np.testing.assert_allclose(strategy.model, expected)
        # edge 0 goes on from the cloud model it received after its upload
        again = strategy.plan(View(idle=(a, b), capacity=2), np.random.default_rng(0))
        np.testing.assert_allclose(again[0].models[ARRAYS], [0.5, 1.5])
        assert strategy.summary() == {"edge_rounds": [1, 1], "cloud_updates": 2}


def test_hierfedavg_waits_for_every_edge_then_averages_by_data_share() -> None:
    strategy = hierarchy("hierfedavg")
    (a, b), (c, d) = (edge.clients for edge in strategy.edges)
    strategy.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0))
    reply(strategy, a, [4, 0], 1)
    assert not reply(strategy, b, [0, 4], 3).changed  # edge 0 waits for the cloud
    assert not strategy.plan(View(idle=(a, b), capacity=2), np.random.default_rng(0))
    reply(strategy, c, [2, 2], 1)
    assert reply(strategy, d, [4, 0], 1).changed
    np.testing.assert_allclose(strategy.model, [2.0, 2.0])  # 0.5 [1, 3] + 0.5 [3, 1]
    assert len(strategy.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0))) == 4


def test_a_lost_task_is_a_drop_and_the_client_returns_with_its_stale_model() -> None:
    strategy = hierarchy("mafsa")
    (a, b), _ = (edge.clients for edge in strategy.edges)
    strategy.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0))
    reply(strategy, a, [4, 0], 1)
    outcome = strategy.on_task_lost(b)  # the edge does not wait: the round closes on a alone
    assert outcome is not None and outcome.changed
    np.testing.assert_allclose(strategy.model, [2.0, 0.0])  # 0 + 0.5 ([4, 0] - 0)
    tasks = {
        x.client: x for x in strategy.plan(View(idle=(a, b), capacity=2), np.random.default_rng(0))
    }
    # b dropped in round 0 and is back in round 1: E = 1, its last local model is the
    # initial one; lr 0.1 * 0.5^(epochs so far + E * epochs per task) with 5 steps of 10
    # over 10 samples = 1 + 4 // 1 = 5 epochs per task
    assert tasks[b].entries == {
        m.MAFSAKeys.OFFLINE: 1,
        m.MAFSAKeys.STALE_LR: 0.1,
        m.MAFSAKeys.LR_STEP: 0.5**5,
    }
    np.testing.assert_allclose(tasks[b].models[STALE], [0.0, 0.0])
    assert tasks[b].settings["lr"] == pytest.approx(0.1 * 0.5**5)
    assert tasks[a].entries == {} and tasks[a].settings["lr"] == pytest.approx(0.1 * 0.5**5)
    # b returns fresh [4, 4] and stale [0, 8]: E_avg = 1, beta = ln 1.5, alpha = 2/3:
    # b's blend (2/3) [4, 4] + (1/3) [0, 8] = [8/3, 16/3]; a's fresh [2, 0]
    reply(strategy, a, [2, 0], 1)
    outcome = reply(strategy, b, [4, 4], 1, stale=np.array([0, 8], dtype=np.float32))
    records = {r["client"]: r for r in outcome.records}
    assert records[b]["E"] == 1 and records[b]["alpha"] == pytest.approx(2 / 3)
    assert records[b]["beta"] == pytest.approx(math.log(1.5)) and records[a]["E"] == 0
    theta = (np.array([2, 0]) + np.array([8 / 3, 16 / 3])) / 2
    np.testing.assert_allclose(strategy.model, [2, 0] + 0.5 * (theta - [2, 0]), rtol=1e-6)


def test_both_rules_see_the_same_dropout_schedule() -> None:
    def schedule(name: str) -> list[tuple[int, int, tuple[int, ...]]]:
        strategy = hierarchy(name, p=0.4, num_clients=12, concurrency=12, edges=3)
        seen = []
        for _ in range(8):
            plan = strategy.plan(View(idle=tuple(range(12)), capacity=12), np.random.default_rng(0))
            for k, edge in enumerate(strategy.edges):
                if edge.open:
                    seen.append((k, edge.round, tuple(sorted(edge.pending))))
            for task in plan:
                reply(
                    strategy,
                    task.client,
                    [1, 1],
                    1,
                    **{n: v for n, v in task.models.items() if n == STALE},
                )
        return seen

    mafsa, hier = schedule("mafsa"), schedule("hierfedavg")
    assert mafsa == hier and len({len(s[2]) for s in mafsa}) > 1  # some rounds lose clients


def test_declared_edges_and_slower_edges() -> None:
    strategy = hierarchy("mafsa", mafsa_edge_slowdown="1,3")
    strategy.bind_edges({0: 1, 1: 1, 2: 0, 3: 7})  # 3 names an edge that does not exist
    assert strategy.edges[1].clients[:2] == [0, 1] and 2 in strategy.edges[0].clients
    factors = strategy.latency_factors()
    assert factors is not None and list(factors[[0, 1, 2]]) == [3.0, 3.0, 1.0]
    with pytest.raises(ConfigError, match="2 edges; give one per edge"):
        hierarchy("mafsa", mafsa_edge_slowdown="1,2,3")
    with pytest.raises(ConfigError, match="set concurrency = num-clients"):
        hierarchy("hierfedavg", concurrency=2)


def test_a_returning_client_trains_its_stale_model_lazily() -> None:
    config = run_config(dataset="digits", model="mlp", num_clients=4, strategy="mafsa")
    model, layout = client_model(config)
    start = get_flat(model).copy()
    stale = start + 0.01
    spec = TaskSpec(
        task_id=1, version=0, lr=0.05, local_epochs=1, batch_size=8, seed=11, returns="model",
        local_steps=3, rules=("mafsa-stale-training",),
        extra={m.MAFSAKeys.OFFLINE: 2, m.MAFSAKeys.STALE_LR: 0.2,
               m.MAFSAKeys.LR_STEP: 0.5},
    )  # fmt: skip
    _, _, sets = train_task(
        config, 1, spec.to_config(), layout.unflatten(start), {STALE: layout.unflatten(stale)}
    )
    set_flat(model, stale)
    x, y = client_data(FederationKey.of(config), 1, "train")
    # On the client's thread count, as train_task: the same kernels, so the same bits.
    with limited(config.client_threads):
        for j, lr in enumerate((0.2, 0.1)):  # two offline rounds, the lr halved between them
            local_train(model, x, y, epochs=1, batch_size=8, lr=lr, seed=12 + j, steps=3)
    np.testing.assert_array_equal(layout.flatten(sets[STALE]), get_flat(model))


@pytest.mark.parametrize("name", ["mafsa", "hierfedavg"])
def test_a_run_with_a_rejected_reply_goes_on_and_reports_its_edges(
    name: str, tmp_path: Path
) -> None:
    values = {
        "strategy": name,
        "dataset": "digits",
        "num-clients": 12,
        "concurrency": 12,
        "mafsa-edges": 3,
        "mafsa-dropout-rate": 0.3,
        "local-steps": 5,
        "batch-size": 10,
        "latency-min": 1.0,
        "latency-max": 2.0,
        "mafsa-edge-slowdown": "1,1,3",
        "max-virtual-time": 30.0,
        "eval-interval": 5.0,
        "test-faults": "nan@4",
        "run-name": name,
        "runs-dir": str(tmp_path),
    }
    run, params = load_config(values)
    summary = run_experiment(run, params, local_transport(run))
    assert summary["updates_rejected"] == 1 and summary["tasks_lost"] == 0
    rounds = summary["edge_rounds"]
    if name == "mafsa":  # edges of speed 1 go on without the slow one
        assert rounds[0] > 2 * rounds[2] and summary["cloud_updates"] == summary["versions"]
    else:  # lockstep: every edge within one round of the others
        assert max(rounds) - min(rounds) <= 1 and summary["cloud_updates"] == min(rounds)
    rows = [json.loads(line) for line in (tmp_path / name / "updates.jsonl").open()]
    assert {"edge", "round", "E", "alpha", "beta"} <= set(rows[0])
    assert 4 not in {r["task"] for r in rows}  # the rejected task's update never counted
    if name == "mafsa":
        assert any(r["E"] > 0 and r["alpha"] < 1 for r in rows)
    accuracies = [
        json.loads(line)["accuracy"] for line in (tmp_path / name / "metrics.jsonl").open()
    ]
    assert summary["acc_std"] == pytest.approx(float(np.std(accuracies)))


def test_a_checkpointed_hierarchy_goes_on_identically() -> None:
    first = hierarchy("mafsa", p=0.4)
    for _ in range(3):
        for task in first.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0)):
            reply(
                first,
                task.client,
                [1, 2],
                1,
                **{n: v for n, v in task.models.items() if n == STALE},
            )
    second = hierarchy("mafsa", p=0.4)
    load_state(second, pickle.loads(pickle.dumps(state_of(first))))
    plans = [
        s.plan(View(idle=(0, 1, 2, 3), capacity=4), np.random.default_rng(0))
        for s in (first, second)
    ]
    assert [(a.client, a.entries, a.settings) for a in plans[0]] == [
        (a.client, a.entries, a.settings) for a in plans[1]
    ]
    assert first.summary() == second.summary()
