"""Strategy math against values worked by hand (docs/algorithms.md)."""

from __future__ import annotations

import numpy as np
import pytest

from fedstale.strategies.base import NoParams, View
from fedstale.strategies.fedasync import FedAsync, FedAsyncParams
from fedstale.strategies.fedavg import FedAvg
from fedstale.strategies.fedbuff import FedBuff, FedBuffParams
from fedstale.strategies.staleness import Staleness
from tests.helpers import V0, run_config, update


def planned(strategy: FedAvg) -> int:
    """How many tasks the strategy dispatches with four idle clients and room for two."""
    view = View(0, (0, 1, 2, 3), (), 2)
    return len(strategy.plan(view, np.random.default_rng(0)))


def test_fedavg_waits_for_the_round_then_weights_by_examples() -> None:
    strategy = FedAvg(run_config(concurrency=2), NoParams(), np.zeros(2))
    assert planned(strategy) == 2
    strategy.on_dispatch(0)
    strategy.on_dispatch(1)
    assert planned(strategy) == 0
    first = strategy.on_update(update([1.0, 2.0], n=1, client=0), V0)
    assert not first.changed
    second = strategy.on_update(update([3.0, 6.0], n=3, client=1), V0)
    # (1 * [1, 2] + 3 * [3, 6]) / 4 = [2.5, 5.0]
    assert second.changed
    np.testing.assert_allclose(strategy.model, [2.5, 5.0])
    assert [r["weight"] for r in second.records] == [0.25, 0.75]
    assert planned(strategy) == 2


def test_fedavg_replaces_a_lost_task() -> None:
    strategy = FedAvg(run_config(concurrency=2), NoParams(), np.zeros(2))
    strategy.on_dispatch(0)
    strategy.on_dispatch(1)
    strategy.on_task_lost(1)
    assert planned(strategy) == 1


@pytest.mark.parametrize(
    ("kind", "tau", "expected"),
    [
        ("constant", 9, 1.0),
        ("poly", 3, 0.5),  # (3 + 1) ** -0.5
        ("poly", 0, 1.0),
        ("hinge", 6, 1.0),  # tau <= b
        ("hinge", 8, 1 / 21),  # 1 / (10 * (8 - 6) + 1)
    ],
)
def test_fedasync_staleness_functions(kind: str, tau: int, expected: float) -> None:
    a = 10.0 if kind == "hinge" else 0.5
    assert Staleness(kind, a, 6.0)(tau) == pytest.approx(expected)


def test_fedasync_mixes_with_decayed_alpha() -> None:
    params = FedAsyncParams(fedasync_alpha=0.6, fedasync_staleness="poly", fedasync_poly_a=0.5)
    strategy = FedAsync(run_config(), params, np.array([1.0, 2.0]))
    outcome = strategy.on_update(update([3.0, 6.0], staleness=3), V0)
    # alpha_t = 0.6 * 4 ** -0.5 = 0.3; w = 0.7 * [1, 2] + 0.3 * [3, 6] = [1.6, 3.2]
    assert outcome.changed
    np.testing.assert_allclose(strategy.model, [1.6, 3.2], rtol=1e-6)
    assert outcome.records[0]["weight"] == pytest.approx(0.3)
    assert strategy.assign(0, V0).settings["proximal_mu"] == pytest.approx(0.005)


def test_fedbuff_flushes_every_k_with_staleness_weights() -> None:
    strategy = FedBuff(run_config(), FedBuffParams(buffer_size=2), np.array([1.0, 1.0]))
    assert not strategy.on_update(update([2.0, 0.0], staleness=0), V0).changed
    outcome = strategy.on_update(update([0.0, 4.0], staleness=3), V0)
    # w + (1/2) * (1 * [2, 0] + 0.5 * [0, 4]) = [1, 1] + [1, 1]
    assert outcome.changed
    np.testing.assert_allclose(strategy.model, [2.0, 2.0])
    assert [r["weight"] for r in outcome.records] == [0.5, 0.25]
    assert len(strategy.buffer) == 0


def test_fedbuff_server_lr_scales_the_step() -> None:
    strategy = FedBuff(
        run_config(), FedBuffParams(buffer_size=1, fedbuff_server_lr=0.5), np.zeros(1)
    )
    strategy.on_update(update([4.0], staleness=8), V0)  # 0.5 * 4 * 9 ** -0.5
    np.testing.assert_allclose(strategy.model, [2.0 / 3.0], rtol=1e-6)
