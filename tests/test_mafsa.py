"""MAFSA's math (ALGORITHMS.md, MAFSA section) against values worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import mafsa as m


def test_beta_for_a_given_mean_staleness() -> None:
    # E = [0, 1, 3]: E_avg over the returning clients = 2; beta = ln(2) / 2
    assert m.beta_for([0, 1, 3]) == pytest.approx(math.log(2) / 2)
    assert m.beta_for([0, 0]) == 0.0
    assert m.alpha_for(0, 0.3) == 1.0
    assert m.alpha_for(2, math.log(2) / 2) == pytest.approx(0.5)  # exp(-ln 2)


def test_one_edge_aggregation_with_a_returning_client() -> None:
    fresh = [np.array([1.0, 0.0], dtype=np.float32), np.array([3.0, 2.0], dtype=np.float32)]
    stale = [None, np.array([7.0, 6.0], dtype=np.float32)]
    # client 2 was away E = 2 rounds: E_avg 2, beta ln(2)/2, alpha 0.5:
    # blended 0.5 [3, 2] + 0.5 [7, 6] = [5, 4]; theta = (100 [1, 0] + 300 [5, 4]) / 400
    theta, alphas, beta = m.edge_aggregate(fresh, stale, [100, 300], [0, 2])
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
    pattern = [[m.online(c, r, 0.3, seed=7) for r in range(50)] for c in range(20)]
    again = [[m.online(c, r, 0.3, seed=7) for r in range(50)] for c in range(20)]
    assert pattern == again  # a function of (seed, client, round) only
    share = 1 - np.mean(pattern)
    assert 0.25 < share < 0.35  # 1,000 draws at p = 0.3
    assert all(m.online(c, r, 0.0, seed=7) for c in range(5) for r in range(5))
    assert pattern != [[m.online(c, r, 0.3, seed=8) for r in range(50)] for c in range(20)]


def test_edge_groups_are_equal_seeded_and_cover_every_client() -> None:
    groups = m.edge_groups(100, 5, seed=3)
    assert [len(g) for g in groups] == [20] * 5
    assert sorted(c for g in groups for c in g) == list(range(100))
    assert groups == m.edge_groups(100, 5, seed=3) != m.edge_groups(100, 5, seed=4)
    assert [len(g) for g in m.edge_groups(7, 3, seed=0)] == [3, 2, 2]
