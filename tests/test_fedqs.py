"""FedQS's rules against values worked by hand (docs/algorithms.md, FedQS)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from fedstale.common.schema import InvalidReply
from fedstale.strategies import fedqs as q
from fedstale.strategies.base import Update, load_state, state_of
from tests.helpers import V0, run_config


def test_minmax_angle_of_two_small_tensors() -> None:
    # [0,1,2] -> [0,.5,1]; [2,1,0] -> [1,.5,0]; cos = .25 / 1.25 = .2
    assert q.minmax_angle(np.array([0.0, 1, 2]), np.array([2.0, 1, 0])) == pytest.approx(
        math.degrees(math.acos(0.2))
    )
    assert q.minmax_angle(np.array([1.0, 2, 3]), np.array([2.0, 4, 6])) == pytest.approx(
        0.0, abs=1e-5
    )
    assert q.minmax_angle(np.array([1.0, 1, 1]), np.array([2.0, 4, 6])) is None


def test_similarity_is_the_mean_over_tensors_skipping_constant_ones() -> None:
    a = np.array([0.0, 1, 2, 5, 5, 1, 3], dtype=np.float32)
    b = np.array([2.0, 1, 0, 1, 2, 3, 1], dtype=np.float32)
    segments = [(0, 3), (3, 5), (5, 7)]  # the middle tensor of a is constant
    # tensor 3: [1,3] -> [0,1]; [3,1] -> [1,0]: 90 degrees
    assert q.similarity(a, b, segments, "angle") == pytest.approx(
        (math.degrees(math.acos(0.2)) + 90.0) / 2
    )
    # l1: |a-b| per tensor: 2+0+2, 4+3, 2+2 -> mean of 4, 7, 4
    assert q.similarity(a, b, segments, "l1") == pytest.approx(5.0)
    assert q.similarity(a, b, segments, "l2") == pytest.approx(
        (math.sqrt(8) + 5.0 + math.sqrt(8)) / 3
    )
    assert q.similarity(a[3:5], b[3:5], [(0, 2)], "angle") is None


def test_four_made_up_clients_their_types_lr_and_momentum() -> None:
    speed_ths, theta_ths, lr, a, m0, k, cap = 1.0, 40.0, 0.1, 0.002, 0.1, 20.0, 0.4
    clients = {  # speed, theta
        "A": (2.0, 60.0),
        "B": (0.5, 50.0),
        "C": (1.5, 20.0),
        "D": (0.25, 36.0),
    }
    kinds = {n: q.classify(s, t, speed_ths, theta_ths) for n, (s, t) in clients.items()}
    assert kinds == {"A": q.FBC, "B": q.SBC, "C": q.FUC, "D": q.SUC}
    factors = {n: q.speed_factor(s, speed_ths) for n, (s, _) in clients.items()}
    assert factors == pytest.approx({"A": 0.5, "B": 2.0, "C": 2 / 3, "D": 4.0})
    lrs = {n: q.new_lr(kinds[n], lr, factors[n], a, (1e-3, 0.2)) for n in clients}
    assert lrs == pytest.approx({"A": 0.1, "B": 0.104, "C": 0.1 - 0.002 * 2 / 3, "D": 0.108})
    # C: 0.1 + min(20 (0.1 * 40 / 20 - 0.1), 0.4) = 0.5; D: 0.1 + 20 (0.1 * 40 / 36 - 0.1)
    assert q.aligned_momentum(20.0, theta_ths, m0, k, cap) == pytest.approx(0.5)
    assert q.aligned_momentum(36.0, theta_ths, m0, k, cap) == pytest.approx(0.1 + 20 / 90)
    assert q.aligned_momentum(0.0, theta_ths, m0, k, cap) == pytest.approx(0.5)


def test_unclassifiable_clients_and_lr_bounds() -> None:
    assert q.classify(0.0, 10.0, 1.0, 40.0) is None  # never aggregated
    assert q.classify(1.0, None, 1.0, 40.0) is None  # no angle yet
    assert q.classify(1.0, 10.0, 0.0, 40.0) is None  # no threshold yet
    assert q.speed_factor(0.05, 1.0) == 9.0
    assert q.new_lr(q.SUC, 0.199, 9.0, 0.002, (1e-3, 0.2)) == 0.2
    assert q.new_lr(q.FUC, 0.002, 9.0, 0.002, (1e-3, 0.2)) == 1e-3


def test_weights_of_a_k3_aggregation_with_one_flagged_update() -> None:
    # p = [.25, .5, .25]; update 0 flagged: (e/2)^(0.1 - 2/20) (1 + min(30/20, 2)^2) = 3.25
    weights = q.aggregation_weights(
        examples=np.array([100, 200, 100]),
        counts=np.array([2.0, 1.0, 3.0]),
        total_count=20.0,
        flags=np.array([True, False, False]),
        thetas=np.array([30.0, 0.0, 0.0]),
        theta_bar=20.0,
    )
    assert weights == pytest.approx([0.8125 / 1.5625, 0.5 / 1.5625, 0.25 / 1.5625])
    # a frequent client's flag counts for less: f_i / sum f = 0.6 -> (e/2)^-0.5
    frequent = q.aggregation_weights(
        np.array([1, 1]),
        np.array([12.0, 1.0]),
        20.0,
        np.array([True, False]),
        np.array([80.0, 0.0]),
        20.0,
    )
    boost = (math.e / 2) ** -0.5 * 5.0  # min(80/20, 2)^2 = 4
    assert frequent == pytest.approx([boost / (boost + 1), 1 / (boost + 1)])


BOOST = (math.e / 2) ** (0.1 - 1 / 3) * (1 + (30 / 20) ** 2)  # f_i / sum f = 1/3


@pytest.mark.parametrize(
    ("ablation", "expected"),
    [
        ("none", [100 * BOOST, 200, 100]),
        ("no-flag-weight", [100, 200, 100]),  # n_i / sum n, the flag ignored
        ("no-feedback", [1, 1, 1]),  # uniform
    ],
)
def test_ablations_of_the_weights(ablation: str, expected: list[float]) -> None:
    # through the rule: clients 0-2 with 100, 200, 100 samples, each aggregated once;
    # client 0's task was flagged with theta 30, theta_bar = mean(30, 10, 20) = 20
    strategy = fedqs(fedqs_ablation=ablation)
    strategy.theta[:] = [30.0, 10.0, 20.0]
    for client in range(3):
        kind = q.FBC if client == 0 else q.FUC
        strategy.pending[client] = q.Sent(kind, 30.0, client == 0, 0.1, 0.0)
    samples = (100, 200, 100)
    outcomes = [
        strategy.on_update(reply(c, [1, 0, 0, 0], n, float(c == 0), 0.0), V0)
        for c, n in enumerate(samples)
    ]
    weights = [record["weight"] for record in outcomes[-1].records]
    assert weights == pytest.approx(np.array(expected) / sum(expected))


def test_thresholds_are_means_of_the_non_zero_values() -> None:
    assert q.mean_nonzero(np.array([0.0, 2.0, 4.0, 0.0])) == 3.0
    assert q.mean_nonzero(np.zeros(3)) == 0.0


def fedqs(kind: type[q.FedQSSGD] = q.FedQSSGD, **params: object) -> q.FedQSSGD:
    run = run_config(num_clients=3, concurrency=3, lr=0.1)
    values = {"buffer-size": 3, **{k.replace("_", "-"): v for k, v in params.items()}}
    strategy = kind(run, q.FedQSParams.model_validate(values), np.zeros(4, dtype=np.float32))
    strategy.bind_segments([(0, 2), (2, 4)])
    return strategy


def reply(client: int, vector: list[float], n: int, flag: float, momentum: float = 0.1) -> Update:
    signals = {q.FedQSKeys.FLAG: flag, q.FedQSKeys.MOMENTUM: momentum}
    signals[q.FedQSKeys.SPREAD] = -1.0
    return Update(client, client, 0, 0, n, np.array(vector, dtype=np.float32), signals)


def test_first_aggregation_sets_counts_speeds_and_thresholds() -> None:
    strategy = fedqs()
    for client in range(3):
        assignment = strategy.assign(client, V0)
        assert assignment.entries[q.FedQSKeys.TYPE] == ""  # nothing to classify yet
        assert assignment.settings == {"lr": 0.1, "momentum": 0.0}  # the run's
    deltas = ([1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 4])
    outcomes = [strategy.on_update(reply(c, d, 100, 0.0), V0) for c, d in enumerate(deltas)]
    assert [o.changed for o in outcomes] == [False, False, True]
    np.testing.assert_allclose(strategy.model, [1 / 3, 2 / 3, 0, 4 / 3], rtol=1e-6)
    np.testing.assert_array_equal(strategy.count, [1, 1, 1])
    np.testing.assert_array_equal(strategy.speed, [1, 1, 1])  # f_i / (3 / 3)
    assert strategy.speed_ths == 1.0 and strategy.theta_ths == 0.0  # no angle yet


def test_every_aggregated_clients_speed_is_refreshed_not_only_the_ks() -> None:
    """counts [3, 2, 1] after a second aggregation of clients 0, 0, 1: the mean count is
    6 / 3 = 2, so speeds [1.5, 1.0, 0.5]; client 2, not in that aggregation, moves too."""
    strategy = fedqs()
    for client in range(3):
        strategy.assign(client, V0)
        strategy.on_update(reply(client, [1, 0, 0, 0], 100, 0.0), V0)
    for client in (0, 0, 1):
        strategy.assign(client, V0)
        strategy.on_update(reply(client, [0, 1, 0, 0], 100, 0.0), V0)
    np.testing.assert_array_equal(strategy.count, [3, 2, 1])
    np.testing.assert_allclose(strategy.speed, [1.5, 1.0, 0.5])
    assert strategy.speed_ths == pytest.approx(1.0)
    np.testing.assert_array_equal(q.refreshed_speeds(np.array([0, 2, 2]), 4), [0, 2, 2])


def test_the_angle_at_dispatch_uses_the_two_newest_models_and_the_last_delta() -> None:
    strategy = fedqs()
    for client in range(3):
        strategy.assign(client, V0)
    for c, d in enumerate(([1, 0, 2, 0], [0, 2, 0, 1], [3, 0, 0, 1])):
        strategy.on_update(reply(c, d, 100, 0.0), V0)
    pseudo = strategy.model - strategy.previous_model  # the mean delta: [4/3, 2/3, 2/3, 2/3]
    strategy.assign(0, V0)
    expected = q.similarity(pseudo, np.array([1, 0, 2, 0.0]), [(0, 2), (2, 4)], "angle")
    assert strategy.theta[0] == pytest.approx(expected)
    # tensor 1: [4/3, 2/3] vs [1, 0] -> [1, 0] both: 0 deg; tensor 2: [2/3, 2/3] constant
    assert expected == pytest.approx(0.0, abs=1e-5)


def test_an_sbc_task_takes_its_flag_from_the_client_and_others_cannot_set_it() -> None:
    strategy = fedqs()
    strategy.speed[:] = [2.0, 0.5, 1.0]
    strategy.speed_ths, strategy.theta_ths = 1.0, 10.0
    strategy.previous_model = np.zeros(4, dtype=np.float32)
    strategy.model = np.array([1, 2, 3, 5], dtype=np.float32)
    strategy.last_delta = {0: np.array([2, 1, 5, 3.0]), 1: np.array([2, 1, 5, 3.0])}
    kinds = [strategy.assign(c, V0).entries[q.FedQSKeys.TYPE] for c in (0, 1)]
    assert kinds == [q.FBC, q.SBC]  # both at 90 degrees > 10
    with pytest.raises(
        InvalidReply, match=re.escape("flag of a FBC task is the server's (1); the reply says 0")
    ):
        strategy.validate(reply(0, [0, 0, 0, 0], 1, 0.0))  # FBC's flag is the server's: on
    with pytest.raises(InvalidReply, match="no FedQS task of client 2"):
        strategy.validate(reply(2, [0, 0, 0, 0], 1, 1.0))
    strategy.validate(reply(1, [0, 0, 0, 0], 1, 1.0, momentum=0.0))  # SBC decides
    queued = strategy.queued(reply(1, [0, 0, 0, 0], 1, 1.0, momentum=0.0))
    assert queued.flag and queued.kind == q.SBC and strategy.momentum[1] == 0.0
    assert queued.lr == pytest.approx(0.1 + 0.002 * 2)


def test_fedqs_avg_keeps_the_start_model_and_state_round_trips() -> None:
    strategy = fedqs(q.FedQSAvg)
    strategy.assign(0, V0)
    strategy.model = np.ones(4, dtype=np.float32)  # moved on while the task was out
    strategy.on_update(reply(0, [2, 2, 2, 2], 10, 0.0), V0)
    np.testing.assert_array_equal(strategy.last_delta[0], [2, 2, 2, 2])  # w_i - start (0)
    copy = fedqs(q.FedQSAvg)
    load_state(copy, state_of(strategy))
    assert len(copy.fifo) == 1 and copy.last_delta[0].tolist() == [2, 2, 2, 2]


def test_uniform_base_weights_are_one_over_k_before_the_feedback_factor() -> None:
    examples, counts, thetas = np.array([100, 300]), np.array([1.0, 3.0]), np.array([20.0, 0])
    flags = np.array([True, False])
    plain = q.aggregation_weights(examples, counts, 4.0, np.array([False, False]), thetas, 10.0)
    np.testing.assert_allclose(plain, [0.25, 0.75])
    uniform = q.aggregation_weights(
        examples, counts, 4.0, np.array([False, False]), thetas, 10.0, uniform=True
    )
    np.testing.assert_allclose(uniform, [0.5, 0.5])
    boost = (math.e / 2) ** (0.1 - 1 / 4) * (1 + 2.0**2)  # theta 20 / 10, capped at 2
    flagged = q.aggregation_weights(examples, counts, 4.0, flags, thetas, 10.0, uniform=True)
    np.testing.assert_allclose(flagged, np.array([0.5 * boost, 0.5]) / (0.5 * boost + 0.5))
    strategy = fedqs(fedqs_base_weights="uniform")
    for client, n in enumerate((100, 200, 700)):
        strategy.assign(client, V0)
        outcome = strategy.on_update(reply(client, [1, 0, 0, 0], n, 0.0), V0)
    assert [r["weight"] for r in outcome.records] == pytest.approx([1 / 3] * 3)


def safl(update: str) -> q.SaflFedSGD:
    run = run_config(num_clients=3, concurrency=3)
    params = q.KFifoParams.model_validate({"buffer-size": 3, "fedqs-fifo-update": update})
    return q.SaflFedSGD(run, params, np.zeros(2, dtype=np.float32))


def test_fifo_update_newest_aggregates_each_clients_latest_update() -> None:
    """Arrivals c0: a, c1: b, c0: c fill K = 3. Uploaded: w = (a + b + c) / 3; newest (the
    authors' simulator): c0's first entry reads its newest update too, w = (c + b + c) / 3."""
    a, b, c = [3.0, 0.0], [0.0, 3.0], [6.0, 6.0]
    results = {}
    for mode in ("uploaded", "newest"):
        strategy = safl(mode)
        for client, vector in ((0, a), (1, b), (0, c)):
            strategy.on_update(Update(client, 0, 0, 0, 1, np.array(vector, np.float32), {}), V0)
        results[mode] = strategy.model
    np.testing.assert_allclose(results["uploaded"], [3.0, 3.0])
    np.testing.assert_allclose(results["newest"], [4.0, 5.0])
